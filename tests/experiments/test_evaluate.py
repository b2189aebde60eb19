"""``attnkit eval``: lm-eval-harness on a tiny random attnkit model and the local tasks in data/lm_eval, offline.

The expected log-likelihoods are computed here from the model's logits on token ids built by hand (one token per
character), so they check AttnKitLM's tokenization, the context/continuation split, the right padding of a
batch and the rolling window, not only that lm-eval ran.
"""

from __future__ import annotations

import json
import math
import string
import sys
from pathlib import Path

import pytest
import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from attnkit.cli import main
from attnkit.models import AttnKitConfig, AttnKitForCausalLM

REPO = Path(__file__).resolve().parents[2]
TASKS = "tests/experiments/data/lm_eval"  # relative to REPO, as the task files' data paths are
CHARS = sorted(set(string.printable) - set("\t\r\x0b\x0c"))
VOCAB = {"<eos>": 0, "<unk>": 1, **{c: i + 2 for i, c in enumerate(CHARS)}}
MAX_LENGTH = 128  # longer than every text + 1, so each rolling log-likelihood is one window


def char_tokenizer() -> PreTrainedTokenizerFast:
    """One token per character (``VOCAB``), no special tokens added; ``<eos>`` is the end of text."""
    tok = Tokenizer(models.WordLevel(VOCAB, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>")


def ids(text: str) -> list[int]:
    return [VOCAB[c] for c in text]


@pytest.fixture(scope="module")
def run_folder(tmp_path_factory) -> Path:
    """A save_pretrained folder of a random PaTH + RoPE model (torch backend) with the character tokenizer."""
    folder = tmp_path_factory.mktemp("run")
    torch.manual_seed(0)
    config = AttnKitConfig(
        vocab_size=len(VOCAB) + 3,
        hidden_size=32,
        num_hidden_layers=2,
        num_heads=2,
        mixer=["path", "rope"],
        backend="torch",
        max_position_embeddings=MAX_LENGTH,
        eos_token_id=0,
        initializer_range=0.2,  # spread the logits, so the choices' log-likelihoods differ clearly
    )
    AttnKitForCausalLM(config).save_pretrained(folder)
    char_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(REPO)


def docs(name: str) -> list[dict]:
    return [json.loads(line) for line in (REPO / TASKS / name).read_text().splitlines()]


@torch.no_grad()
def loglikelihood(model: AttnKitForCausalLM, context: list[int], continuation: list[int]) -> float:
    """``log p(continuation | context)``, summed over the continuation's tokens."""
    tokens = torch.tensor([context + continuation])
    logprobs = model(input_ids=tokens, use_cache=False).logits.double().log_softmax(-1)[0]
    targets = tokens[0, len(context) :]
    return logprobs[len(context) - 1 : -1].gather(-1, targets[:, None]).sum().item()


def test_eval_scores_match_the_models_logits(run_folder, offline, tmp_path, capsys):
    out = tmp_path / "results.json"
    # spaces and empty names in --tasks are dropped
    argv = ["eval", str(run_folder), "--tasks", "attnkit_toy_mc, attnkit_toy_ppl,", "--include-path", TASKS]
    argv += ["--device", "cpu", "--batch-size", "4", "--bootstrap-iters", "0", "--log-samples", "--out", str(out)]
    assert main(argv) == 0
    stdout = capsys.readouterr().out
    assert "|attnkit_toy_mc |" in stdout and "acc_norm" in stdout and "bits_per_byte" in stdout
    results = json.loads(out.read_text())
    assert results["max_length"] == MAX_LENGTH  # the config's max_position_embeddings
    model = AttnKitForCausalLM.from_pretrained(run_folder).eval()

    # multiple choice: every choice's log-likelihood, then acc (argmax) and acc_norm (argmax per character)
    samples = sorted(results["samples"]["attnkit_toy_mc"], key=lambda s: s["doc_id"])
    mc_docs = docs("toy_mc.jsonl")
    assert len(samples) == len(mc_docs)
    acc = acc_norm = 0
    for sample, doc in zip(samples, mc_docs):
        context = ids(f"Question: {doc['question']}\nAnswer:")
        expected = [loglikelihood(model, context, ids(" " + choice)) for choice in doc["choices"]]
        reported = [ll for ll, _ in sample["filtered_resps"]]
        assert reported == pytest.approx(expected, rel=1e-5, abs=1e-4)
        acc += max(range(len(expected)), key=expected.__getitem__) == doc["label"]
        normed = [ll / len(choice) for ll, choice in zip(expected, doc["choices"])]
        acc_norm += max(range(len(normed)), key=normed.__getitem__) == doc["label"]
    scores = results["results"]["attnkit_toy_mc"]
    assert scores["acc,none"] == pytest.approx(acc / len(mc_docs))
    assert scores["acc_norm,none"] == pytest.approx(acc_norm / len(mc_docs))

    # perplexity: each text scored after the end-of-text token; bits per byte over all texts
    texts = [doc["text"] for doc in docs("toy_text.jsonl")]
    expected = [loglikelihood(model, [VOCAB["<eos>"]], ids(text)) for text in texts]
    samples = sorted(results["samples"]["attnkit_toy_ppl"], key=lambda s: s["doc_id"])
    assert [s["filtered_resps"][0] for s in samples] == pytest.approx(expected, rel=1e-5, abs=1e-4)
    bits_per_byte = -sum(expected) / sum(len(t.encode()) for t in texts) / math.log(2)
    assert results["results"]["attnkit_toy_ppl"]["bits_per_byte,none"] == pytest.approx(bits_per_byte, rel=1e-5)


def test_eval_without_lm_eval_prints_the_install_hint(run_folder, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "lm_eval", None)
    monkeypatch.setitem(sys.modules, "lm_eval.models.huggingface", None)
    assert main(["eval", str(run_folder), "--tasks", "attnkit_toy_mc"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "pip install 'attnkit[eval]'" in err


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--batch-size", "0"], "batch_size:"),
        (["--include-path", "no/such/folder"], "include_path:"),
        (["--tasks", ", "], "tasks:"),
    ],
    ids=["batch-size", "include-path", "no-task"],
)
def test_eval_input_errors(run_folder, offline, capsys, extra, message):
    argv = ["eval", str(run_folder), "--tasks", "attnkit_toy_mc", "--include-path", TASKS, *extra]
    assert main(argv) == 2 and message in capsys.readouterr().err


def test_eval_needs_a_model_folder_with_a_tokenizer(run_folder, offline, tmp_path, capsys):
    AttnKitForCausalLM(AttnKitConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_heads=2)).save_pretrained(
        tmp_path / "bare"
    )
    for folder, message in [(tmp_path / "empty", "no config.json"), (tmp_path / "bare", "has no tokenizer")]:
        assert main(["eval", str(folder), "--tasks", "attnkit_toy_mc", "--include-path", TASKS]) == 2
        assert message in capsys.readouterr().err


def test_attnkit_lm_checks_the_model_and_the_tokenizer(run_folder, tmp_path):
    from attnkit.experiments.evaluate.lm import AttnKitLM

    lm = AttnKitLM(pretrained=str(run_folder), device="cpu")
    assert "token_type_ids" not in lm.tokenizer("Hi")
    assert lm.max_length == MAX_LENGTH and lm.eot_token_id == lm.prefix_token_id == VOCAB["<eos>"]

    llama = LlamaConfig(
        vocab_size=128, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
    )
    LlamaForCausalLM(llama).save_pretrained(tmp_path / "llama")
    with pytest.raises(ValueError, match="pretrained: .* 'llama' model"):
        AttnKitLM(pretrained=str(tmp_path / "llama"), tokenizer=str(run_folder), device="cpu")

    small = AttnKitConfig(vocab_size=16, hidden_size=16, num_hidden_layers=1, num_heads=2, backend="torch")
    AttnKitForCausalLM(small).save_pretrained(tmp_path / "small")
    with pytest.raises(ValueError, match="tokenizer: .* vocabulary has 16"):
        AttnKitLM(pretrained=str(tmp_path / "small"), tokenizer=str(run_folder), device="cpu")
