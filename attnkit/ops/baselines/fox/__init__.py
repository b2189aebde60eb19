"""FoX, the Forgetting Transformer's attention (softmax attention with the gate bias ``G_i − G_j``), without any
``T × T`` tensor: a blockwise PyTorch backend (``torch_impl.py``) and fused Triton kernels (``triton/``, wrapped as
custom ops in ``parallel.py``). The public function is :func:`attnkit.ops.softmax_attention`; the mathematics and
the algorithm are in ``README.md`` beside this file."""
