"""``attnkit reproduce``: the three papers' claims, checked by one command each.

    attnkit reproduce {path,tapa,vla,all} [--scale smoke|full] [--out DIR] [--resume] [--cells PATTERN] [--jobs N]
                      [--max-minutes M] [--stop-minutes M] [--list] [--report-only]

Each paper module (``vla``, ``tapa``, ``path``) declares its experiments at both scales and its claims, with the
published numbers and the criterion of each verdict. An experiment is a learning-rate sweep (``sweep``: every
model with the same budget, the best learning rate chosen on the validation split) or a probe (``probes``); both
are made of cells (``cells``: one run each, cached as a JSON file under ``<out>/<paper>/cells/``, never rerun).
``verdicts`` turns the results into CONFIRMED / PARTIAL / REFUTED / INCONCLUSIVE / NOT RUN, and ``report`` writes
``<out>/<paper>/report.md`` with its plots and ``report.json``.

On a CPU the cells run by default in one single-threaded process per core (``--jobs 0``). Full scale on one
GPU: the models are tiny, so run several cells at once (``--jobs 8`` runs eight processes sharing the GPU) and in
pieces that fit a time limit, reusing what earlier calls finished::

    attnkit reproduce vla --scale full --out reports --jobs 8 --max-minutes 8 --resume

``--max-minutes`` starts no cell after the limit (the running ones finish); the cells left are NOT RUN in the
report until a later call with ``--resume`` runs them. ``--stop-minutes`` names when an outer limit will stop the
run: a cell whose siblings (the same model and setting at another learning rate or seed) took longer than what is
left then does not start, so the limit kills fewer cells mid-run. A run killed by an outer time limit keeps every
cell that finished (each record is written by a rename) but writes no report: ``--report-only`` writes it from the
finished cells, running none. ``benchmarks/run_gpu.sh reproduce`` does all of this in one call on the H200, one
process a CPU core. ``--cells PATTERN`` runs a subset (``--list`` shows the names). A folder that already holds
finished cells is refused without ``--resume``.

Chained experiments (continued pretraining, the RoPE -> PaTH conversion) start from the trained weights of an
earlier experiment's cells, which keep their final model under ``<out>/<paper>/cells/models/`` (about 13 MB each
at full scale); their cells are declared once the parent has chosen its learning rate, so a run goes in stages.
The models serve only the children still to run: a later run without them (given the cell records alone) reruns
a parent only when one of its children has not finished.
"""

from .command import add_arguments, run

__all__ = ["add_arguments", "run"]
