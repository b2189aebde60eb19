"""Linear attention's fused chunked Triton kernels: the forward (``forward.py``: a state pass over chunks, then the
output of every chunk in parallel) and the backward (``backward.py``: a reverse state pass, then dQ and dK, dV per
chunk), wrapped as custom ops with an autograd registration in ``chunk.py``. The public function is
:func:`attnkit.ops.linear_attention` (``backend="triton"``); the mathematics are in ``README.md`` beside this file.
"""
