"""The CPU kernels' C++ (`kernels/cpu_decode.cpp`: decode attention; `kernels/cpu_decoder_ops.cpp`:
the decoder's per-row ops; `kernels/cpu_prefill.cpp`: paged prefill attention;
`kernels/cpu_quant_attention.cpp`: attention over quantized copies made on the fly, for the
statistics; `kernels/cpu_flash.h`: their flash-attention core; `kernels/cpu_vec.h`: fp32/bf16/fp16
loads and stores), compiled once per machine with torch's
cpp_extension and cached in TORCH_EXTENSIONS_DIR, in a folder of this checkout and interpreter
(`build_dir`: two checkouts' processes sharing one folder rebuilt it for each other, each deleting
the library the other loads; the first time takes a compiler's minute; a changed source rebuilds). `kvplan prepare-model` (so `make setup`) and the engine's start build it, so no job's
first decode waits for a compiler. Where no compiler is, `module()` is None and the launchers
(`kernels.paged_decode`, `kernels.paged_prefill`, `kernels.decoder_ops`, `kernels.kv_write`) take
their torch references."""
from __future__ import annotations

import hashlib
import logging
import sys
import threading
from pathlib import Path

log = logging.getLogger("kvplan.kernels")

SOURCES = [Path(__file__).with_name(n) for n in ("cpu_decode.cpp", "cpu_decoder_ops.cpp", "cpu_prefill.cpp",
                                                   "cpu_quant_attention.cpp", "cpu_decode_step.cpp",
                                                   "cpu_statistics.cpp")]
HEADERS = [Path(__file__).with_name(n) for n in ("cpu_vec.h", "cpu_flash.h")]
_LOCK = threading.Lock()
_MODULE: list = []          # [module] once built, [None] once it could not be


def module():
    """The compiled extension, built at first use (None: it could not be built here)."""
    if not _MODULE:
        with _LOCK:
            if not _MODULE:
                try:
                    from torch.utils.cpp_extension import load
                    log.info("loading the CPU decode kernels (the first run compiles them)")
                    _MODULE.append(load("kvplan_cpu_decode", sources=[str(x) for x in SOURCES],
                                        build_directory=str(build_dir()),
                                        extra_cflags=["-O3", "-march=native", "-fopenmp",      # at::parallel_for is
                                                      f"-DKVPLAN_HEADERS={headers_hash()}"],  # OpenMP: torch's libgomp
                                        extra_ldflags=["-fopenmp"], verbose=False))
                except Exception as e:              # noqa: BLE001  (no compiler, no headers: the references)
                    log.warning("CPU decode kernels not built (%s): decode attention uses the torch references", e)
                    _MODULE.append(None)
    return _MODULE[0]


def build_dir() -> Path:
    """TORCH_EXTENSIONS_DIR/kvplan_cpu_decode-<hash of this checkout's kernels folder and the
    interpreter's prefix>, made if missing."""
    from torch.utils.cpp_extension import _get_build_directory
    key = hashlib.sha256(f"{Path(__file__).resolve().parent}\0{sys.prefix}".encode()).hexdigest()[:12]
    d = Path(_get_build_directory("kvplan_cpu_decode", verbose=False)).with_name(f"kvplan_cpu_decode-{key}")
    d.mkdir(parents=True, exist_ok=True)
    return d


def headers_hash() -> str:
    """The headers' contents, hashed into the build flags: torch rebuilds an extension when its
    sources or flags change, not its headers."""
    return hashlib.sha256(b"".join(h.read_bytes() for h in HEADERS)).hexdigest()[:16]


def build() -> bool:
    """Build (or load the cached build of) the kernels now -> whether they are there."""
    return module() is not None
