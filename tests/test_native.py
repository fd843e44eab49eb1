"""quantkit.core.native: a C file built once into the cache folder and loaded; without a compiler, with a file that
does not compile, or with QUANTKIT_NATIVE=0, None and the caller's torch path (a warning says why)."""
import shutil
import warnings

import pytest

from quantkit.core import native

SOURCE = "int64_t answer(void) { return 42; }\n"


def build(tmp_path, text=SOURCE):
    source = tmp_path / "probe.c"
    source.write_text("#include <stdint.h>\n" + text)
    return native.load.__wrapped__(source)  # around the per-process cache


@pytest.fixture
def cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("QUANTKIT_NATIVE", raising=False)
    return tmp_path / "cache" / "quantkit" / "native"


def test_a_c_file_is_built_once_into_the_cache(tmp_path, cache_home):
    if shutil.which("cc") is None:
        pytest.skip("no C compiler here")
    library = build(tmp_path)
    assert library.answer() == 42
    built = list(cache_home.glob("probe-*.so"))
    assert len(built) == 1 and not list(cache_home.glob("tmp*"))  # no partial file left
    mtime = built[0].stat().st_mtime_ns
    assert build(tmp_path).answer() == 42 and built[0].stat().st_mtime_ns == mtime  # reused, not rebuilt


def test_no_compiler_warns_and_gives_none(tmp_path, cache_home, monkeypatch):
    monkeypatch.setenv("CC", "no-such-compiler-here")
    with pytest.warns(UserWarning, match=r"no C compiler .*install gcc or clang"):
        assert build(tmp_path) is None


def test_a_file_that_does_not_compile_warns_and_gives_none(tmp_path, cache_home):
    if shutil.which("cc") is None:
        pytest.skip("no C compiler here")
    with pytest.warns(UserWarning, match="could not build probe.c"):
        assert build(tmp_path, "this is not C") is None
    assert not list(cache_home.glob("*"))


def test_a_cache_folder_that_cannot_be_written_is_named(tmp_path, monkeypatch):
    if shutil.which("cc") is None:
        pytest.skip("no C compiler here")
    (tmp_path / "file").write_text("a file where the cache folder would go")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "file"))
    monkeypatch.delenv("QUANTKIT_NATIVE", raising=False)
    with pytest.warns(UserWarning, match=r"could not build probe.c into .*file.*set XDG_CACHE_HOME"):
        assert build(tmp_path) is None


def test_quantkit_native_0_turns_it_off_silently(tmp_path, cache_home, monkeypatch):
    monkeypatch.setenv("QUANTKIT_NATIVE", "0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert build(tmp_path) is None
