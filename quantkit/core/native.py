"""Small C helpers, compiled on first use with the machine's own C compiler and loaded with ctypes.

Some calibration searches (the trellis's Viterbi search) are loops that torch can only run as many small tensor ops,
each a pass over memory; one C loop per step, vectorized across sequences with the compiler's vector extensions,
does the same work several times faster. No build step is needed at install: the source ships with the package, is
compiled once per machine (`-O3 -march=native`, falling back to plain `-O3`) and cached under
$XDG_CACHE_HOME/quantkit/native (~/.cache by default), named by a hash of the source, the flags, the compiler and the
CPU. Where no compiler works, or QUANTKIT_NATIVE=0, `load` returns None and the caller keeps its torch path: the
results are the same (float32 rounding aside), only slower. ctypes releases the GIL during a call, so callers may
run several calls at once from Python threads.
"""
import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path
from typing import Optional

FLAG_SETS = (("-O3", "-march=native", "-pthread"), ("-O3", "-pthread"))
# A source that asks for OpenMP is compiled with it first, then, where the compiler has none, as the others are (its
# pragmas then ignored). Its parallel loops then run on torch's own threads: a library asking for "libgomp.so.1" is
# given the copy torch has already loaded (the same soname), so no second pool competes with torch's for the cores.
OPENMP = "-fopenmp"
DISABLE_VARIABLE = "QUANTKIT_NATIVE"


def cache_folder() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "quantkit" / "native"


def _cpu_name() -> str:
    """The CPU's model line (Linux), else platform's: a library built for one CPU is not reused on another."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _compile(compiler: str, source: Path, flags: tuple, target: Path) -> Optional[str]:
    """Compile `source` into the shared library `target`, atomically (a temporary file renamed: processes that
    compile at once, torchrun's ranks, each finish with a whole file). None when done, else why not."""
    partial = None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, partial = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        done = subprocess.run([compiler, *flags, "-shared", "-fPIC", "-o", partial, str(source)],
                              capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            return (done.stderr.strip().splitlines() or ["it failed"])[-1]
        os.replace(partial, target)
        return None
    except (OSError, subprocess.SubprocessError) as e:  # a cache folder we cannot write, a compiler that hangs
        return str(e)
    finally:
        if partial is not None and os.path.exists(partial):
            os.unlink(partial)


@cache
def load(source: Path, openmp: bool = False) -> Optional[ctypes.CDLL]:
    """The shared library built from the C file `source` (compiled on the first call per machine; with `openmp`,
    with OpenMP where the compiler has it), or None (with one warning naming the cause) where it cannot be built or
    QUANTKIT_NATIVE=0."""
    if os.environ.get(DISABLE_VARIABLE, "1") == "0":
        return None
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        warnings.warn(f"no C compiler ({os.environ.get('CC', 'cc')}) found: {source.name} runs as torch ops, "
                      "several times slower (install gcc or clang, or set CC)")
        return None
    text, why = source.read_bytes(), None
    flag_sets = ((*FLAG_SETS[0], OPENMP),) + FLAG_SETS if openmp else FLAG_SETS
    for flags in flag_sets:
        key = hashlib.sha256(b"\0".join([text, " ".join(flags).encode(), compiler.encode(),
                                         _cpu_name().encode()])).hexdigest()[:16]
        target = cache_folder() / f"{source.stem}-{key}.so"
        why = None if target.exists() else _compile(compiler, source, flags, target)
        if why is None:
            try:
                return ctypes.CDLL(str(target))
            except OSError as e:
                why = str(e)
    warnings.warn(f"{compiler} could not build {source.name} into {cache_folder()} ({why}): it runs as torch ops, "
                  "several times slower (set XDG_CACHE_HOME to a folder you can write, or install gcc)")
    return None


def function(source: Path, name: str, argtypes: list, restype=None, openmp: bool = False):
    """The C function `name` of the library built from `source` (`openmp`: see load), with its ctypes argument and
    result types set, or None where the library cannot be built (load's warning says why)."""
    library = load(source, openmp)
    if library is None:
        return None
    fn = getattr(library, name)
    fn.argtypes, fn.restype = argtypes, restype
    return fn


def side_by_side(run, count: int, workers: int) -> None:
    """run(0) .. run(count - 1) on `workers` threads at once, the caller's one of them (ctypes lets go of the GIL
    during a C call): each thread takes the next index until none is left (a builtin iterator's next is atomic
    under the GIL)."""
    items = iter(range(count))

    def drain():
        for i in items:
            run(i)

    helpers = [_pool(workers - 1).submit(drain) for _ in range(min(workers, count) - 1)]
    drain()
    for helper in helpers:
        helper.result()


@cache
def _pool(workers: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(workers)
