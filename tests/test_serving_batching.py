"""Continuous batching against transformers' own model on the same weights: a sequence's greedy
tokens in a batch (joining and leaving mid-batch) equal its tokens alone, logprobs equal log_softmax."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from shardstream.convert import convert
from shardstream.errors import GroupLost, InsufficientMemory, InvalidOption
from shardstream.store import open_store
from shardstream.stream import StreamingModel
from shardstream.serving.batching import BatchEngine
from shardstream.serving.protocol import NO_TOKEN, SamplingParams, open_sequence
from tiny_models import save_checkpoint, tiny_config, tiny_model

FAMILIES = ["llama", "qwen2", "qwen3", "mistral", "gemma", "phi3", "mixtral", "qwen2_moe", "qwen3_moe", "gpt2",
            "gpt_neox", "falcon"]
EOS = 2


def _prompt(length: int, seed: int) -> list[int]:
    return torch.randint(3, 128, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _alone(reference, prompt: list[int], new_tokens: int) -> list[int]:
    """transformers' greedy generate for this prompt alone, up to and including EOS."""
    ids = torch.tensor([prompt])
    out = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             do_sample=False, pad_token_id=0, eos_token_id=EOS)
    return out[0, len(prompt):].tolist()


def _streaming(tmp: Path, family: str):
    reference = save_checkpoint(family, tmp / "ckpt")
    convert(tmp / "ckpt", tmp / "store", progress=False)
    return reference, StreamingModel(open_store(tmp / "store"), max_resident_memory=0)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    reference, model = _streaming(tmp_path_factory.mktemp("llama"), "llama")
    yield reference, model
    model.close()


def _tokens(sequence) -> tuple[list[int], str]:
    events = list(sequence)
    return [e.token for e in events if e.token != NO_TOKEN], events[-1].finish_reason


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_in_a_changing_batch_equal_tokens_alone(tmp_path, family):
    reference, model = _streaming(tmp_path, family)
    with BatchEngine(model, eos_token_ids={EOS}, pad_token_id=0, max_batch_size=8, prefill_chunk_tokens=8) as engine:
        specs = {"a": (_prompt(5, 1), 9), "b": (_prompt(11, 2), 4), "c": (_prompt(3, 3), 7)}
        first = {name: engine.submit(p, SamplingParams(max_new_tokens=n)) for name, (p, n) in specs.items()}
        early = [next(iter(first["a"])) for _ in range(2)]           # the batch is decoding now
        late = {"d": (_prompt(14, 4), 6), "e": (_prompt(2, 5), 5)}     # join mid-batch (14 tokens: 2 chunks)
        joined = {name: engine.submit(p, SamplingParams(max_new_tokens=n)) for name, (p, n) in late.items()}
        leaving = engine.submit(_prompt(7, 6), SamplingParams(max_new_tokens=20))
        got_before_cancel = [next(iter(leaving)).token for _ in range(3)]
        leaving.cancel()
        rest, finish = _tokens(leaving)
        assert finish == "cancelled"
        assert got_before_cancel + rest == _alone(reference, _prompt(7, 6), 20)[:len(got_before_cancel + rest)]
        a_rest, _ = _tokens(first["a"])
        assert [e.token for e in early] + a_rest == _alone(reference, *specs["a"])
        for name, sequence in {**first, **joined}.items():
            if name == "a":
                continue
            prompt, new = {**specs, **late}[name]
            tokens, finish = _tokens(sequence)
            want = _alone(reference, prompt, new)
            assert tokens == want, name
            assert finish == ("stop" if want[-1] == EOS else "length")
        model.close()


def test_sliding_window_attention_stays_exact_with_padding_and_chunks():
    """Mistral with a 4-token window: transformers' masks apply the window over the padded batch."""
    config = tiny_config("mistral")
    config.sliding_window = 4
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(config).eval()
    with BatchEngine(reference, eos_token_ids=set(), pad_token_id=0, prefill_chunk_tokens=3,
                     idle_prefill_tokens=3) as engine:
        prompts = [_prompt(n, n) for n in (3, 9, 6)]
        sequences = [engine.submit(p, SamplingParams(max_new_tokens=8)) for p in prompts]
        for prompt, sequence in zip(prompts, sequences):
            assert _tokens(sequence)[0] == _alone(reference, prompt, 8)


def test_one_pass_over_the_blocks_serves_the_whole_batch(llama):
    _, model = llama
    with BatchEngine(model, eos_token_ids=set(), pad_token_id=0, max_batch_size=4) as engine:
        sequences = [engine.submit(_prompt(4 + i, i), SamplingParams(max_new_tokens=6)) for i in range(4)]
        for sequence in sequences:
            assert len(_tokens(sequence)[0]) == 6
        assert engine.tokens_generated == 24
        # all four submitted before the thread woke or at most in two groups: 1-2 prefills + 5 decode steps
        assert engine.forward_passes <= 2 + 5 + 5


def test_logprobs_and_prompt_logprobs_equal_log_softmax_of_the_reference(llama):
    reference, model = llama
    with BatchEngine(model, eos_token_ids=set(), pad_token_id=0, prefill_chunk_tokens=5, idle_prefill_tokens=5) as engine:
        prompt = _prompt(9, 7)
        other = engine.submit(_prompt(4, 8), SamplingParams(max_new_tokens=3))   # padding beside it
        sequence = engine.submit(prompt, SamplingParams(max_new_tokens=4, logprobs=3, prompt_logprobs=True))
        events = list(sequence)
        list(other)
    ids = torch.tensor([prompt + [e.token for e in events]])
    with torch.no_grad():
        want = torch.log_softmax(reference(ids).logits[0].float(), -1)
    assert sequence.prompt_logprobs[0] is None
    for i, entry in enumerate(sequence.prompt_logprobs[1:], start=1):
        assert entry.token == prompt[i]
        assert abs(entry.logprob - want[i - 1, prompt[i]].item()) < 1e-4
    for i, event in enumerate(events):
        row = want[len(prompt) - 1 + i]
        assert event.logprob.token == event.token
        assert abs(event.logprob.logprob - row[event.token].item()) < 1e-4
        assert [t for t, _ in event.logprob.top] == torch.topk(row, 3).indices.tolist()
        assert event.logprob.top[0][1] == pytest.approx(row.max().item(), abs=1e-4)


def test_sampling_is_per_sequence_and_repeatable_by_seed(llama):
    _, model = llama
    with BatchEngine(model, eos_token_ids=set(), pad_token_id=0) as engine:
        prompt = _prompt(6, 9)
        hot = SamplingParams(max_new_tokens=8, temperature=1.5, seed=7)
        first, greedy_k, second = (engine.submit(prompt, hot),
                                   engine.submit(prompt, SamplingParams(max_new_tokens=8, temperature=1.0, top_k=1)),
                                   engine.submit(prompt, hot))
        greedy = engine.submit(prompt, SamplingParams(max_new_tokens=8))
        other_seed = engine.submit(prompt, SamplingParams(max_new_tokens=8, temperature=1.5, seed=8))
        no_repeat = engine.submit(prompt, SamplingParams(max_new_tokens=8, presence_penalty=100.0))
        a, b, g, k, o, n = (_tokens(s)[0] for s in (first, second, greedy, greedy_k, other_seed, no_repeat))
    assert a == b and a != o       # same seed, same tokens; another seed, other tokens
    assert k == g                  # top_k=1 is greedy whatever the temperature
    assert len(set(n)) == len(n)   # a large presence penalty never repeats a token


def test_submit_refuses_an_empty_or_too_long_prompt(llama):
    _, model = llama
    with BatchEngine(model, eos_token_ids={EOS}, pad_token_id=0) as engine:
        with pytest.raises(InvalidOption, match="prompt is empty"):
            engine.submit([], SamplingParams(max_new_tokens=4))
        with pytest.raises(InvalidOption, match="sampling parameters out of range"):
            engine.submit([5], SamplingParams(max_new_tokens=4, top_p=0.0))
        with pytest.raises(InvalidOption, match="prompt token 128 is not an id of the model's vocabulary"):
            engine.submit([5, 128], SamplingParams(max_new_tokens=4))
        with pytest.raises(InvalidOption, match=r"plus max_new_tokens \(10\) exceeds the model's context of 64"):
            engine.submit(_prompt(60, 1), SamplingParams(max_new_tokens=10))


def test_a_failing_step_fails_its_sequences_and_the_engine_keeps_serving():
    """A block that raises mid-pass (as a failed read would) fails that pass's sequences only."""
    reference = tiny_model("llama")
    broken = {"on": True}

    def fail(module, args):
        if broken["on"]:
            raise RuntimeError("block 1 could not be read")

    hook = reference.model.layers[1].register_forward_pre_hook(fail)
    with BatchEngine(reference, eos_token_ids={EOS}, pad_token_id=0) as engine:  # a plain transformers model works too
        with pytest.raises(RuntimeError, match="block 1 could not be read"):
            list(engine.submit(_prompt(4, 2), SamplingParams(max_new_tokens=3)))
        broken["on"] = False
        tokens, _ = _tokens(engine.submit(_prompt(5, 1), SamplingParams(max_new_tokens=5)))
        assert tokens == _alone(reference, _prompt(5, 1), 5)
        hook.remove()


def test_a_long_prefill_is_chunked_between_the_decode_steps_of_the_others():
    """28 chunks of 2 tokens: the running sequence finishes its 20 tokens before the newcomer starts."""
    with BatchEngine(tiny_model("llama"), eos_token_ids=set(), pad_token_id=0, prefill_chunk_tokens=2) as engine:
        running = engine.submit(_prompt(4, 1), SamplingParams(max_new_tokens=20))
        next(iter(running))
        newcomer = engine.submit(_prompt(56, 2), SamplingParams(max_new_tokens=1))
        list(newcomer)
        assert running.done  # its 20th token came before the newcomer's first
        assert len(_tokens(running)[0]) == 19


def test_an_idle_engine_prefills_a_burst_in_one_pass_and_chunks_beside_decoding():
    """Nothing decoding: 4 prompts of 10 tokens in one pass, not 5 chunks of 8 tokens; with a sequence
    decoding, the newcomer's 10 tokens go in chunks of 8 (4 rows x 2 columns would stall it longer)."""
    reference = tiny_model("llama")
    passes: list[tuple[int, int]] = []   # (rows, columns) of every pass, prefill and decode, in order
    newcomer_in, gated = threading.Event(), []

    def on_pass(rows: int, columns: int) -> None:
        passes.append((rows, columns))
        if gated and len(passes) > 1:   # the running sequence's decode steps wait for the newcomer to be submitted,
            newcomer_in.wait(60)         # however the threads are scheduled: it is still decoding when it comes

    with BatchEngine(reference, eos_token_ids=set(), pad_token_id=0, prefill_chunk_tokens=8, on_pass=on_pass) as engine:
        burst = [engine.submit(_prompt(10, i), SamplingParams(max_new_tokens=3)) for i in range(4)]
        assert [_tokens(s)[0] for s in burst] == [_alone(reference, _prompt(10, i), 3) for i in range(4)]
        assert passes[0] == (4, 10) and len(passes) == 3   # one prefill pass, two decode steps
        passes.clear()
        gated.append(True)
        running = engine.submit(_prompt(4, 9), SamplingParams(max_new_tokens=12))
        next(iter(running))
        newcomer = engine.submit(_prompt(10, 8), SamplingParams(max_new_tokens=2))
        newcomer_in.set()
        assert _tokens(newcomer)[0] == _alone(reference, _prompt(10, 8), 2)
        assert [shape for shape in passes if shape[0] == 1 and shape[1] > 1] == [(1, 4), (1, 8), (1, 2)]


def test_an_idle_prefill_that_does_not_fit_in_memory_goes_in_chunks(llama):
    """The memory left holds the chunked prefill's temporaries but not one pass's: chunked, all admitted;
    a sequence alone that fits neither way goes in chunks too."""
    _, model = llama
    prompts = [_prompt(40, i) for i in range(4)]
    passes: list[tuple[int, int]] = []
    with BatchEngine(model, eos_token_ids=set(), pad_token_id=0, prefill_chunk_tokens=8,
                     memory_left=lambda: free,   # the memory the machine has left, as measured: set below
                     on_pass=lambda rows, columns: passes.append((rows, columns))) as engine:
        unsent = [open_sequence(p, SamplingParams(max_new_tokens=2), 128, "cpu", lambda: None) for p in prompts]
        one_pass = engine.memory_needs(unsent, engine.idle_prefill_tokens)[1]
        chunked = engine.memory_needs(unsent, engine.prefill_chunk_tokens)[1]
        alone = engine.memory_needs(unsent[:1], engine.prefill_chunk_tokens, ahead=1)[1]   # counted while none runs
        assert chunked < one_pass
        free = (chunked + one_pass) // 2
        group = [engine.submit(p, SamplingParams(max_new_tokens=2)) for p in prompts]
        for sequence in group:
            assert len(_tokens(sequence)[0]) == 2
        assert passes[:20] == [(4, 2)] * 20
        # one sequence alone fitting neither way is refused (it was run anyway, into the kernel's kill)
        free = alone // 2
        with pytest.raises(InsufficientMemory, match="a prompt of 40 tokens needs .* left; send a shorter prompt"):
            _tokens(engine.submit(prompts[0], SamplingParams(max_new_tokens=2)))
        free = alone   # the engine lives: one that fits is answered
        assert len(_tokens(engine.submit(prompts[0], SamplingParams(max_new_tokens=2)))[0]) == 2


def test_a_sequence_whose_tokens_ahead_do_not_fit_grows_its_cache_until_the_memory_ends_it(caplog):
    """A request without max_tokens asks for the whole context. Alone, it is admitted with as few tokens
    ahead as the memory left holds (here a fixed amount the engine is told), its reservation widens as its
    tokens come while that memory holds it, and it ends with "length" where it holds no more; its tokens
    are those it has alone, and the reservation never passed the memory."""
    reference = tiny_model("llama")
    prompt, asked = _prompt(5, 1), SamplingParams(max_new_tokens=50)
    reserved: list[int] = []   # the batch's reservation after every pass
    with BatchEngine(reference, eos_token_ids=set(), pad_token_id=0,
                     memory_left=lambda: memory - engine.reserved_bytes,   # `memory` (set below) in all
                     on_pass=lambda rows, columns: reserved.append(engine.reserved_bytes)) as engine:
        unsent = open_sequence(prompt, asked, 128, "cpu", lambda: None)
        memory = engine.memory_needs([unsent], engine.idle_prefill_tokens, ahead=20)[1]
        with caplog.at_level(logging.WARNING, logger="shardstream.batching"):
            tokens, finish = _tokens(engine.submit(prompt, asked))
    assert finish == "length" and 20 < len(tokens) < 50, (finish, len(tokens))
    assert tokens == _alone(reference, prompt, len(tokens))
    assert len(set(reserved)) > 2 and max(reserved) <= memory
    assert f'ended a sequence after {len(tokens)} tokens with finish_reason "length"' in caplog.text


@pytest.mark.parametrize("options,bound", [(dict(max_batch_size=1), "max_batch_size=1"),
                                           (dict(kv_cache_budget=4000), "KV-cache budget")])
def test_the_bound_that_limits_the_batch_is_logged(caplog, options, bound):
    reference = tiny_model("llama")  # 4 layers x 2 kv heads x 8 x 2 x 4 bytes = 512 bytes a token
    with BatchEngine(reference, eos_token_ids=set(), pad_token_id=0, **options) as engine:
        with caplog.at_level(logging.INFO, logger="shardstream.batching"):
            sequences = [engine.submit(_prompt(3, i), SamplingParams(max_new_tokens=2)) for i in range(3)]
            outputs = [_tokens(s)[0] for s in sequences]
    assert outputs == [_alone(reference, _prompt(3, i), 2) for i in range(3)]
    assert bound in caplog.text


def test_close_ends_waiting_and_running_sequences():
    engine = BatchEngine(tiny_model("llama"), eos_token_ids=set(), pad_token_id=0, max_batch_size=1)
    sequences = [engine.submit(_prompt(3, i), SamplingParams(max_new_tokens=60)) for i in range(2)]
    engine.close()
    for sequence in sequences:
        assert list(sequence)[-1].finish_reason in ("cancelled", "length")


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_the_reserved_cache_writes_in_place_and_gives_transformers_logits(family):
    """kvcache.ReservedLayer: a decode step writes its column into the reservation (no copy of the
    cache per step, the point of it), a step past the reservation widens it, and the logits equal those
    of transformers' own DynamicCache, bit for bit."""
    from transformers import DynamicCache

    from shardstream.serving import kvcache

    model = tiny_model(family).eval()
    ids = torch.tensor([_prompt(6, 1), _prompt(6, 2)])
    ours, theirs = kvcache.reserved_cache(8), DynamicCache()
    with torch.no_grad():
        for step in range(4):   # prefill 6 columns, then 3 decode steps: the last one outgrows 8
            columns = ids if step == 0 else ids[:, :1] + step
            want = model(columns, past_key_values=theirs, use_cache=True).logits
            before = [layer._keys.data_ptr() for layer in ours.layers]
            got = model(columns, past_key_values=ours, use_cache=True).logits
            assert torch.equal(got, want)
            moved = [layer._keys.data_ptr() for layer in ours.layers] != before
            assert moved == (step in (0, 3)), step   # reserved on the first pass, widened past 8 columns
    assert ours.get_seq_length() == theirs.get_seq_length() == 9


def test_the_batch_takes_the_memory_admission_counted(llama):
    """The running batch's reservation is exactly what admission's kv_peak counts for it (rows x
    (widest row + most tokens still to come) x KV bytes per token), after joins and leaves."""
    from shardstream.serving.admission import kv_peak

    _, model = llama
    seen = []

    def recorded(rows: int, columns: int) -> None:
        running = engine.running
        if running:
            remaining = max(s.params.max_new_tokens - len(s.generated) for s in running)
            seen.append((engine.reserved_bytes, kv_peak(engine.shape, len(running), engine.batch_width, remaining)))

    with BatchEngine(model, eos_token_ids=set(), pad_token_id=0, max_batch_size=8, on_pass=recorded) as engine:
        first = [engine.submit(_prompt(n, n), SamplingParams(max_new_tokens=m)) for n, m in ((4, 12), (9, 3))]
        next(iter(first[0]))
        late = engine.submit(_prompt(6, 7), SamplingParams(max_new_tokens=5))
        for sequence in [*first, late]:
            _tokens(sequence)
    assert len(seen) > 5
    assert all(reserved == counted for reserved, counted in seen), seen


@pytest.mark.parametrize("gather", [0.0, 0.1])
def test_requests_sent_together_start_together(llama, gather):
    """An idle engine gathers a burst (requests 10 ms apart) into one prefill pass; without gathering the
    first starts alone and the burst costs more passes over the blocks."""
    import threading
    import time

    _, model = llama
    with BatchEngine(model, eos_token_ids=set(), pad_token_id=0, gather_seconds=gather) as engine:
        sequences = []

        def send():
            for seed in range(4):
                sequences.append(engine.submit(_prompt(5, seed), SamplingParams(max_new_tokens=4)))
                time.sleep(0.01)

        sender = threading.Thread(target=send)
        sender.start()
        sender.join()
        assert all(len(_tokens(s)[0]) == 4 for s in sequences)
    together = 1 + 3   # one prefill pass, then 3 decode steps for all four
    assert (engine.forward_passes == together) == (gather > 0), engine.forward_passes


def test_abort_fails_the_sequences_in_flight_and_refuses_new_ones():
    """What serve does when its model can no longer run (a lost tensor-parallel rank): the consumers get
    the error at once, while the step in progress still waits (here on a block that does not return)."""
    reference = tiny_model("llama")
    passes, release = [], threading.Event()

    def stall(module, args):
        passes.append(1)
        if len(passes) > 2:   # the prefill and one decode step go through, then a step hangs
            release.wait(30)

    reference.model.layers[1].register_forward_pre_hook(stall)
    lost = GroupLost("the tensor-parallel group failed (Connection reset by peer)")
    with BatchEngine(reference, eos_token_ids=set(), pad_token_id=0) as engine:
        events = iter(engine.submit(_prompt(4, 2), SamplingParams(max_new_tokens=50)))
        next(events)
        next(events)                      # the third pass hangs now
        engine.abort(lost)
        with pytest.raises(GroupLost, match="Connection reset by peer"):
            next(events)
        with pytest.raises(GroupLost):
            engine.submit(_prompt(4, 3), SamplingParams(max_new_tokens=2))
        release.set()
