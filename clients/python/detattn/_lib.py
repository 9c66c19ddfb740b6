"""ctypes bindings of libdetattn (plugin/include/detattn.h): the one implementation of the
protocol. Only this module touches ctypes; the rest of the package uses its names."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from pathlib import Path

# Mirrors DETATTN_STATUS_MAP (append-only, gRPC numbers).
STATUS_NAMES = {
    0: "OK", 1: "CANCELLED", 2: "UNKNOWN", 3: "INVALID_ARGUMENT", 4: "DEADLINE_EXCEEDED",
    5: "NOT_FOUND", 6: "ALREADY_EXISTS", 7: "PERMISSION_DENIED", 8: "RESOURCE_EXHAUSTED",
    9: "FAILED_PRECONDITION", 10: "ABORTED", 11: "OUT_OF_RANGE", 12: "UNIMPLEMENTED",
    13: "INTERNAL", 14: "UNAVAILABLE", 15: "DATA_LOSS",
}

PLANE_AUTO, PLANE_COPY, PLANE_SHM, PLANE_CUDA = 0, 1, 2, 3
PLANE_NAMES = {"auto": PLANE_AUTO, "copy": PLANE_COPY, "shm": PLANE_SHM, "cuda": PLANE_CUDA}
BF16, FP16 = 0, 1


class Model(ctypes.Structure):
    _fields_ = [("n_layers", ctypes.c_uint32), ("n_q_heads", ctypes.c_uint32), ("n_kv_heads", ctypes.c_uint32),
                ("head_dim", ctypes.c_uint32), ("dtype", ctypes.c_int), ("scale", ctypes.c_float),
                ("softcap", ctypes.c_float), ("window", ctypes.c_uint32), ("page_tokens", ctypes.c_uint32)]


class ServerInfo(ctypes.Structure):
    _fields_ = [("server_version", ctypes.c_char * 32), ("protocol_version", ctypes.c_uint32), ("model", Model),
                ("backend", ctypes.c_char * 16), ("arch", ctypes.c_char * 32), ("kernel_version", ctypes.c_uint32),
                ("split_tokens", ctypes.c_uint32), ("tile_tokens", ctypes.c_uint32), ("fingerprint", ctypes.c_uint64),
                ("max_message_bytes", ctypes.c_uint64), ("max_tokens_per_request", ctypes.c_uint32),
                ("kv_capacity_tokens", ctypes.c_uint64), ("kv_pages", ctypes.c_uint32),
                ("data_planes", ctypes.c_uint32)]


class Stats(ctypes.Structure):
    _fields_ = [("uptime_ms", ctypes.c_uint64), ("requests", ctypes.c_uint64), ("errors", ctypes.c_uint64),
                ("forwards", ctypes.c_uint64), ("forward_tokens", ctypes.c_uint64), ("batches", ctypes.c_uint64),
                ("batch_tokens_mean", ctypes.c_double), ("batch_tokens_p50", ctypes.c_double),
                ("batch_tokens_p99", ctypes.c_double), ("batch_tokens_max", ctypes.c_double),
                ("batch_requests_mean", ctypes.c_double), ("batch_requests_max", ctypes.c_double),
                ("queue_us_mean", ctypes.c_double), ("queue_us_p50", ctypes.c_double),
                ("queue_us_p99", ctypes.c_double), ("queue_us_max", ctypes.c_double),
                ("inrow_items", ctypes.c_uint64), ("partial_items", ctypes.c_uint64),
                ("kv_pages_total", ctypes.c_uint32), ("kv_pages_used", ctypes.c_uint32),
                ("kv_pages_free", ctypes.c_uint32), ("sequences", ctypes.c_uint32), ("clients", ctypes.c_uint32),
                ("arenas", ctypes.c_uint32), ("arena_bytes", ctypes.c_uint64)]


class SeqIO(ctypes.Structure):
    _fields_ = [("seq", ctypes.c_uint64), ("pos", ctypes.c_uint32), ("n_tokens", ctypes.c_uint32),
                ("q", ctypes.c_void_p), ("k", ctypes.c_void_p), ("v", ctypes.c_void_p), ("o", ctypes.c_void_p),
                ("lse", ctypes.c_void_p)]


class ConnectOpts(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_uint32), ("data_plane", ctypes.c_int), ("arena_bytes", ctypes.c_uint64),
                ("timeout_ms", ctypes.c_int), ("tls_ca", ctypes.c_char_p), ("tls_cert", ctypes.c_char_p),
                ("tls_key", ctypes.c_char_p), ("tls_server_name", ctypes.c_char_p)]


def _candidates() -> list[str]:
    here = Path(__file__).resolve().parent
    out = [os.environ.get("DETATTN_LIBRARY", "")]
    out += [str(p) for p in sorted(here.glob("libdetattn.so*"))]           # installed beside the package
    out += [str(p) for p in sorted(here.parents[2].glob("build/lib/libdetattn.so*"))]  # source tree build
    found = ctypes.util.find_library("detattn")
    if found:
        out.append(found)
    out += ["/usr/local/lib/libdetattn.so", "libdetattn.so.0", "libdetattn.so"]
    return [c for c in out if c]


def _load() -> ctypes.CDLL:
    global path
    errors = []
    for cand in _candidates():
        try:
            lib = ctypes.CDLL(cand)
            lib.detattn_connect_ex  # noqa: B018 - a library new enough for this package
            path = cand
            return lib
        except (OSError, AttributeError) as e:
            errors.append(f"{cand}: {e}")
    raise ImportError("libdetattn not found (install it with deploy/install-python.sh, or set DETATTN_LIBRARY): "
                      + "; ".join(errors))


path = ""  # the library loaded, as found
lib = _load()
c_client_p = ctypes.c_void_p
c_call_p = ctypes.c_void_p

_SIGS = {
    "detattn_status_name": (ctypes.c_char_p, [ctypes.c_int]),
    "detattn_errmsg": (ctypes.c_char_p, []),
    "detattn_connect_opts_init": (None, [ctypes.POINTER(ConnectOpts)]),
    "detattn_connect_ex": (ctypes.c_int, [ctypes.POINTER(c_client_p), ctypes.c_char_p, ctypes.POINTER(ConnectOpts)]),
    "detattn_close": (None, [c_client_p]),
    "detattn_set_timeout": (None, [c_client_p, ctypes.c_int]),
    "detattn_hello": (ctypes.c_int, [c_client_p, ctypes.POINTER(ServerInfo)]),
    "detattn_stats_get": (ctypes.c_int, [c_client_p, ctypes.POINTER(Stats)]),
    "detattn_seq_open": (ctypes.c_int, [c_client_p, ctypes.POINTER(ctypes.c_uint64)]),
    "detattn_seq_fork": (ctypes.c_int, [c_client_p, ctypes.c_uint64, ctypes.POINTER(ctypes.c_uint64)]),
    "detattn_seq_truncate": (ctypes.c_int, [c_client_p, ctypes.c_uint64, ctypes.c_uint32]),
    "detattn_seq_close": (ctypes.c_int, [c_client_p, ctypes.c_uint64]),
    "detattn_forward": (ctypes.c_int, [c_client_p, ctypes.c_uint32, ctypes.POINTER(SeqIO), ctypes.c_size_t]),
    "detattn_forward_start": (ctypes.c_int, [c_client_p, ctypes.c_uint32, ctypes.POINTER(SeqIO), ctypes.c_size_t,
                                             ctypes.POINTER(c_call_p)]),
    "detattn_call_wait": (ctypes.c_int, [c_call_p]),
    "detattn_data_plane_get": (ctypes.c_int, [c_client_p]),
    "detattn_arena_alloc": (ctypes.c_void_p, [c_client_p, ctypes.c_size_t]),
    "detattn_arena_free": (None, [c_client_p, ctypes.c_void_p]),
}
for _name, (_res, _args) in _SIGS.items():
    _f = getattr(lib, _name)
    _f.restype = _res
    _f.argtypes = _args


def errmsg() -> str:
    """The message of this thread's last failed call (libdetattn keeps it per thread)."""
    m = lib.detattn_errmsg()
    return m.decode("utf-8", "replace") if m else ""


class CudaApi:
    """The CUDA plane's entry points (detattn_forward_cuda, detattn_forward_cuda_start), or
    stand-ins with the same signatures in tests."""

    def __init__(self, forward, forward_start):
        self.forward = forward
        self.forward_start = forward_start


_CUDA_SIGS = {
    "detattn_forward_cuda": (ctypes.c_int, [c_client_p, ctypes.c_uint32, ctypes.POINTER(SeqIO), ctypes.c_size_t,
                                            ctypes.c_void_p]),
    "detattn_forward_cuda_start": (ctypes.c_int, [c_client_p, ctypes.c_uint32, ctypes.POINTER(SeqIO),
                                                  ctypes.c_size_t, ctypes.c_void_p, ctypes.POINTER(c_call_p)]),
}
_cuda_api: "CudaApi | None | bool" = False  # False: not looked up yet


def cuda_api() -> "CudaApi | None":
    """The CUDA plane of the loaded libdetattn, bound on first use; None when the library
    predates it (the package works without it: CUDA tensors then go through host memory)."""
    global _cuda_api
    if _cuda_api is False:
        fns = []
        for name, (res, args) in _CUDA_SIGS.items():
            try:
                f = getattr(lib, name)
            except AttributeError:
                fns = None
                break
            f.restype, f.argtypes = res, args
            fns.append(f)
        _cuda_api = CudaApi(*fns) if fns else None
    return _cuda_api

