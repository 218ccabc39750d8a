"""Speculative decoding over streamed weights: transformers' assisted generation through the block hooks."""

from __future__ import annotations

import itertools

import pytest
import torch
from transformers import AutoModelForCausalLM

from shardstream.convert import convert
from shardstream.errors import DraftMismatch
from shardstream import AutoModel
from tiny_models import save_checkpoint, tiny_config

PROMPT = torch.tensor([[1, 5, 9, 14, 3, 7]])


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(target streaming model over a store, its reference transformers model, a draft streaming model)."""
    folder = tmp_path_factory.mktemp("spec")
    reference = save_checkpoint("llama", folder / "target")
    save_checkpoint("llama", folder / "draft", seed=1)
    for name in ("target", "draft"):
        convert(folder / name, folder / f"{name}-store", progress=False)
    target = AutoModel.from_pretrained(folder / "target-store", max_resident_memory=0, progress=False)
    draft = AutoModel.from_pretrained(folder / "draft-store", max_resident_memory=0, progress=False)
    yield target, reference, draft
    target.close()
    draft.close()


def _greedy(model, **kwargs) -> list[int]:
    return model.generate(PROMPT, max_new_tokens=24, do_sample=False, pad_token_id=0, **kwargs)[0].tolist()


def test_greedy_with_a_streamed_draft_equals_the_target_alone(pair):
    target, reference, draft = pair
    expected = _greedy(reference)
    assert _greedy(target) == expected
    assert _greedy(target, assistant_model=draft) == expected


def test_a_perfect_draft_verifies_many_tokens_per_pass_over_the_blocks(pair):
    target, reference, _ = pair
    reference.generation_config.update(num_assistant_tokens=8, assistant_confidence_threshold=0.0)
    _greedy(target)
    plain_passes = target.forward_passes
    assert _greedy(target, assistant_model=reference) == _greedy(reference)
    assert plain_passes == 24 and target.forward_passes == 3  # 8 tokens checked per pass


def test_a_draft_with_another_vocabulary_is_refused(pair, tmp_path):
    target, _, _ = pair
    config = tiny_config("llama")
    config.vocab_size = 96
    other = AutoModelForCausalLM.from_config(config)
    with pytest.raises(DraftMismatch, match="vocabulary .96 tokens. differs from the target's .128."):
        _greedy(target, assistant_model=other)


VOCAB, NEW = 6, 2


def _tiny_vocab_store(folder, seed: int):
    config = tiny_config("llama")
    config.update(dict(vocab_size=VOCAB, bos_token_id=0, eos_token_id=None, pad_token_id=0, initializer_range=0.6))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.generation_config.eos_token_id = None
    model.save_pretrained(folder / "ckpt")
    convert(folder / "ckpt", folder / "store", progress=False)
    return model


def _exact(model, prompt: torch.Tensor) -> dict[tuple[int, ...], float]:
    """P(next NEW tokens) under plain sampling at temperature 1, by enumeration."""
    probs = {}
    with torch.no_grad():
        for tokens in itertools.product(range(VOCAB), repeat=NEW):
            ids, p = prompt, 1.0
            for token in tokens:
                p *= model(ids).logits[0, -1].softmax(-1)[token].item()
                ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
            probs[tokens] = p
    return probs


def _chi2_pvalue(counts: dict, probs: dict, n: int) -> float:
    """Pearson's chi-square test; outcomes expected fewer than 5 times are pooled into one bin."""
    rare = [k for k, p in probs.items() if n * p < 5]
    bins = [(counts.get(k, 0), n * p) for k, p in probs.items() if n * p >= 5]
    bins.append((sum(counts.get(k, 0) for k in rare), n * sum(probs[k] for k in rare)))
    stat = sum((seen - expected) ** 2 / expected for seen, expected in bins if expected > 0)
    df = torch.tensor((len(bins) - 1) / 2, dtype=torch.float64)
    return torch.special.gammaincc(df, torch.tensor(stat / 2, dtype=torch.float64)).item()


@pytest.fixture
def one_thread():
    """Hundreds of tiny forward passes: torch's thread pool only adds overhead (a lot on busy cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_speculative_sampling_keeps_the_target_distribution(tmp_path, one_thread):
    """Speculative samples fit the target's exact distribution; the draft's own samples do not
    (so the test can tell a wrong acceptance rule from the right one)."""
    reference = _tiny_vocab_store(tmp_path / "t", seed=0)
    draft = _tiny_vocab_store(tmp_path / "d", seed=3)
    prompt = torch.tensor([[3, 1, 5]])  # no pad token (0): generate() would mask it out
    target_probs, draft_probs = _exact(reference, prompt), _exact(draft, prompt)
    assert 0.5 * sum(abs(target_probs[k] - draft_probs[k]) for k in target_probs) > 0.3  # they disagree a lot
    n = 300
    options = dict(max_new_tokens=NEW, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=0)
    draft.generation_config.num_assistant_tokens = NEW
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    torch.manual_seed(0)
    with AutoModel.from_pretrained(tmp_path / "t" / "store", max_resident_memory=0, progress=False) as target:
        counts: dict[tuple[int, ...], int] = {}
        for _ in range(n):
            key = tuple(target.generate(prompt, assistant_model=draft, **options)[0, -NEW:].tolist())
            counts[key] = counts.get(key, 0) + 1
    draft_counts: dict[tuple[int, ...], int] = {}
    for _ in range(n):
        key = tuple(draft.generate(prompt, **options)[0, -NEW:].tolist())
        draft_counts[key] = draft_counts.get(key, 0) + 1
    assert _chi2_pvalue(counts, target_probs, n) > 1e-3
    assert _chi2_pvalue(draft_counts, target_probs, n) < 1e-6


def _draft_with_own_tokenizer(folder, vocab_size: int):
    """A draft store whose tokenizer maps characters to other ids than the target's char tokenizer."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    config = tiny_config("llama")
    config.vocab_size = vocab_size
    torch.manual_seed(2)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder / "ckpt")
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{chr(c): 3 + 126 - c for c in range(32, 127)}}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>",
                            pad_token="<pad>").save_pretrained(folder / "ckpt")
    convert(folder / "ckpt", folder / "store", progress=False)
    return folder / "store"


def test_the_cli_uses_universal_assisted_decoding_for_another_vocabulary(tmp_path, capsys):
    from shardstream.front.generate_cli import generate_command
    from tiny_models import llama_store_with_tokenizer

    store, _, _ = llama_store_with_tokenizer(tmp_path / "target")
    generate_command(str(store), prompt="Hello, world", max_new_tokens=10, no_progress=True)
    plain = capsys.readouterr().out
    other = _draft_with_own_tokenizer(tmp_path / "other", vocab_size=100)
    generate_command(str(store), prompt="Hello, world", max_new_tokens=10, draft=str(other), no_progress=True)
    assert capsys.readouterr().out == plain
    same_size = _draft_with_own_tokenizer(tmp_path / "same", vocab_size=128)
    with pytest.raises(DraftMismatch, match="another tokenizer than the model but a vocabulary of the same size"):
        generate_command(str(store), prompt="Hello, world", max_new_tokens=10, draft=str(same_size))


@pytest.mark.parametrize("resident, streamed", [("0", True), ("auto", False)])
def test_a_streaming_model_guesses_further_by_default(tmp_path, capsys, resident, streamed):
    """A streamed pass costs a read of the blocks: 8 draft tokens a pass (18 tokens in 2 passes with a
    perfect draft); all blocks resident: transformers' adaptive schedule, which also stops a guess
    where the draft is unsure (more passes)."""
    from shardstream.front.generate_cli import generate_command
    from tiny_models import llama_store_with_tokenizer

    store, _, _ = llama_store_with_tokenizer(tmp_path / "target")
    generate_command(str(store), prompt="Hello, world", max_new_tokens=18, draft=str(store), profile=True,
                     max_resident_memory=resident, no_progress=True)
    report = capsys.readouterr().err.splitlines()[-1]
    passes = int(report.split(" target passes")[0].split()[-1])
    assert report.startswith("18 new tokens") and (passes == 2) == streamed, report
