"""detattn: deterministic, batch-invariant attention served by detattnd.

    import detattn
    with detattn.Client("ipc:///run/detattn/detattnd.sock") as c:
        info = c.hello()
        with c.seq_open() as s:
            (out,) = c.forward(0, [detattn.SeqIO(s, 0, q, k, v)])

The same request gives the same bits whatever else the daemon batches. ``detattn.torch``
has an attention module for Llama-style decoders, ``detattn.model`` a small pure-torch
model, ``python3 -m detattn.repro`` the reproducibility experiment.
"""

from .client import Client, ForwardCall, ModelInfo, Output, Sequence, SeqIO, ServerInfo, Stats, from_bf16, to_bf16
from .errors import (Cancelled, DeadlineExceeded, DetattnError, FailedPrecondition, Internal, InvalidArgument,
                     NotFound, PermissionDenied, ResourceExhausted, Unavailable, Unimplemented)

__all__ = ["Client", "ForwardCall", "ModelInfo", "Output", "Sequence", "SeqIO", "ServerInfo", "Stats", "from_bf16",
           "to_bf16", "DetattnError", "Cancelled", "DeadlineExceeded", "FailedPrecondition", "Internal",
           "InvalidArgument", "NotFound", "PermissionDenied", "ResourceExhausted", "Unavailable", "Unimplemented"]
__version__ = "0.1.0"
