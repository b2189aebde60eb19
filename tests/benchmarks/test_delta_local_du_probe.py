"""``benchmarks/delta_local_du_probe.py`` under the interpreter: exact dots, so the two forms and their repeats agree
bit for bit in every case, and the module's settings are put back."""

from __future__ import annotations

from attnkit.ops.common.triton import delta_bwd, delta_fwd
from benchmarks import delta_local_du_probe


def test_delta_local_du_probe_smoke():
    saved = (delta_fwd.STATE_PREFETCH, delta_fwd.STATE_BV, delta_bwd.LOCAL_DU)
    rows = delta_local_du_probe.main()
    assert len(rows) == 4 * len(delta_local_du_probe.NAMES)
    assert all(r["repeat_off"] == r["repeat_on"] == r["on_vs_off"] == 0.0 for r in rows)
    assert (delta_fwd.STATE_PREFETCH, delta_fwd.STATE_BV, delta_bwd.LOCAL_DU) == saved
