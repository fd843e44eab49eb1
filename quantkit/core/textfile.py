"""Text files a user names (a recipe, prompts, a calibration text): read as UTF-8, every failure one line that names
the file and the fix."""
import os
from pathlib import Path

from quantkit.core.errors import QuantkitError

NAME_MAX, PATH_MAX = 255, 4096  # bytes of one path component and of a whole path (Linux)


def check_path_name(text, what: str, reserve: int = 0) -> None:
    """A path a user gave that no file system takes (a name past 255 bytes, a path past 4096, bytes that are not
    UTF-8) is one error line, not the OSError a stat() of it raises, nor a failure after the work. reserve: bytes
    the caller adds to the last name (quantize stages OUT as .NAME.tmp-PID)."""
    text = str(text)
    try:
        encoded = text.encode("utf-8")
    except UnicodeEncodeError:
        raise QuantkitError(f"{what} {text!r} holds bytes that are not UTF-8: choose a name in UTF-8") from None
    parts = Path(text).parts
    for i, part in enumerate(parts):
        limit = NAME_MAX - (reserve if i == len(parts) - 1 else 0)
        if len(part.encode("utf-8")) > limit:
            staged = f", as quantkit also writes it with a suffix of {reserve}" if reserve and limit < NAME_MAX else ""
            raise QuantkitError(f"{what} {text[:60]}...: a name of {len(part.encode('utf-8'))} bytes is longer than "
                                f"the file systems take ({limit} bytes{staged}): choose a shorter name")
    length = len(os.path.abspath(encoded)) + reserve
    if length > PATH_MAX:
        raise QuantkitError(f"{what} {text[:60]}...: the path is {length} bytes, longer than the file systems take "
                            f"({PATH_MAX}): choose a shorter path")


def read_user_text(path, what: str, expect: str = "a text file") -> str:
    """The UTF-8 text of `path`. what: how the message names the file ("recipe file"); expect: what to pass instead
    ("an existing .yaml/.yml/.toml file")."""
    check_path_name(path, what)
    path = Path(path).expanduser()
    if path.is_dir():
        raise QuantkitError(f"{what} {path} is a folder, not a file: pass {expect}")
    if not path.exists():
        raise QuantkitError(f"{what} {path} not found: pass {expect}")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise QuantkitError(f"{what} {path} is not UTF-8 text ({e.reason} at byte {e.start}): save it as "
                            "UTF-8") from None
    except OSError as e:
        raise QuantkitError(f"{what} {path} cannot be read ({e.strerror}): check that it is a readable file") from None
