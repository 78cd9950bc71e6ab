"""Schema of `tidal convert`: a GGUF model file to convert into a Hugging Face model directory by hand."""

from pathlib import Path

from tidal.config.base import Config


class ConvertConfig(Config):
    """`tidal convert model.gguf`: what `model.name = "model.gguf"` does on first use, run by hand (to convert
    once on a login node, or to get a directory to copy elsewhere)."""

    gguf: Path
    """The .gguf file (also the first bare argument)."""
    output_dir: Path | None = None
    """Where the Hugging Face directory goes (default: tidal's cache, `$TIDAL_CACHE_DIR/models/gguf/`,
    where `model.name = "<the .gguf file>"` finds it without converting again)."""
    force: bool = False
    """Convert again even where a converted directory exists."""
