"""Text files a user names (a recipe, prompts, a calibration text): read as UTF-8, every failure one line that names
the file and the fix."""
from pathlib import Path

from quantkit.core.errors import QuantkitError

NAME_MAX, PATH_MAX = 255, 4096  # bytes of one path component and of a whole path (Linux)


def check_path_name(text, what: str) -> None:
    """A path a user gave that no file system takes (a component past 255 bytes, a path past 4096, bytes that are
    not UTF-8) is one error line, not the OSError a stat() of it raises."""
    text = str(text)
    try:
        encoded = text.encode("utf-8")
    except UnicodeEncodeError:
        raise QuantkitError(f"{what} {text!r} holds bytes that are not UTF-8: pass a path in UTF-8") from None
    if len(encoded) > PATH_MAX or any(len(p.encode("utf-8")) > NAME_MAX for p in Path(text).parts):
        raise QuantkitError(f"{what} {text[:60]}... is longer than a file system takes ({NAME_MAX} bytes a name, "
                            f"{PATH_MAX} a path): check the value")


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
        raise QuantkitError(f"{what} {path} is not UTF-8 text ({e.reason} at byte {e.start}): save it as UTF-8") from None
    except OSError as e:
        raise QuantkitError(f"{what} {path} cannot be read ({e.strerror}): check that it is a readable file") from None
