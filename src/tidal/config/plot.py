"""Schema of `tidal plot`: which run to draw and where the PNG goes."""

from pathlib import Path

from pydantic import Field

from tidal.config.base import Config


class PlotConfig(Config):
    """`tidal plot <output_dir>`: draw a `tidal rl` run, finished, running or crashed, from its metrics files."""

    output_dir: Path
    """The run's directory (what `tidal rl` was given as output_dir); also the first bare argument."""
    path: Path | None = None
    """Where the PNG goes (default: <output_dir>/plots/rl.png)."""
    smoothing: int | None = Field(default=None, gt=0)
    """Steps of the reward's moving average (default: a tenth of the steps, at least 1)."""
