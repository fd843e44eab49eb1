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


OPENMP_SOURCE = """#ifdef _OPENMP
int64_t built_with_openmp(void) { return 1; }
#else
int64_t built_with_openmp(void) { return 0; }
#endif
"""


def test_openmp_is_asked_for_and_given_up_where_the_compiler_has_none(tmp_path, cache_home, monkeypatch):
    """openmp=True builds with OpenMP first; a compiler that refuses the flag gets the plain build, silently."""
    if shutil.which("cc") is None:
        pytest.skip("no C compiler here")
    source = tmp_path / "omp_probe.c"
    source.write_text("#include <stdint.h>\n" + OPENMP_SOURCE)
    plain = native.load.__wrapped__(source)
    assert plain.built_with_openmp() == 0
    with_openmp = native.load.__wrapped__(source, openmp=True)
    assert with_openmp.built_with_openmp() in (0, 1)  # 1 where cc has OpenMP (gcc does)
    monkeypatch.setattr(native, "OPENMP", "-fno-such-openmp-flag")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the fallback says nothing
        refused = native.load.__wrapped__(source, openmp=True)
    assert refused is not None and refused.built_with_openmp() == 0
