"""Text files a user names (a recipe, prompts, a calibration text): read as UTF-8, every failure one line that names
the file and the fix."""
from pathlib import Path

from quantkit.core.errors import QuantkitError


def read_user_text(path, what: str, expect: str = "a text file") -> str:
    """The UTF-8 text of `path`. what: how the message names the file ("recipe file"); expect: what to pass instead
    ("an existing .yaml/.yml/.toml file")."""
    path = Path(path).expanduser()
    if path.is_dir():
        raise QuantkitError(f"{what} {path} is a folder, not a file: pass {expect}")
    if not path.exists():
        raise QuantkitError(f"{what} {path} not found: pass {expect}")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise QuantkitError(f"{what} {path} is not UTF-8 text ({e.reason} at byte {e.start}): save it as UTF-8") from None
    except OSError as e:
        raise QuantkitError(f"{what} {path} cannot be read ({e.strerror}): check that it is a readable file") from None
