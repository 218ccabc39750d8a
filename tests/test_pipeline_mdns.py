"""mDNS end to end: an agent subprocess started with --advertise is found by the coordinator's
--discover, which then plans, deploys and generates on it. Skipped where the machine has no
multicast (checked by announcing and finding a service inside this process first)."""

from __future__ import annotations

import uuid

import pytest
import warm_python

from shardstream.errors import InvalidOption
from shardstream.pipeline.cli import coordinator_command
from shardstream.pipeline.discovery import advertise, discover
from shardstream.pipeline.local import spawn_agents
from shardstream.store import open_store
from tiny_models import llama_store_with_tokenizer

pytest.importorskip("zeroconf")
TOKEN = "test-token"
PROMPT = "Once upon a time"


def _multicast_works() -> bool:
    """Announce a dummy service in this process and look for it: no answer (or no usable network
    interface, which zeroconf reports in several ways) means no multicast here."""
    try:
        announcer = advertise(f"probe-{uuid.uuid4().hex[:8]}", 9, "127.0.0.1")
    except Exception:   # an environment probe: any failure to announce means "not here"
        return False
    try:
        return "http://127.0.0.1:9" in discover(1.5)
    except Exception:
        return False
    finally:
        announcer.close()


def test_an_advertised_agent_is_discovered_and_runs_the_model(tmp_path, capsys):
    if not _multicast_works():
        pytest.skip("this machine does not deliver mDNS multicast on loopback")
    store, reference, tokenizer = llama_store_with_tokenizer(tmp_path / "model")
    agents = spawn_agents(["mdns-agent"], TOKEN, tmp_path / "agents", advertise=True, start=warm_python.popen)
    try:
        assert agents[0].url in discover(2.0)
        # a second browse right after the first: the agent may wait out mDNS's once-a-second limit on
        # multicasting a record, and a loaded machine answers later still
        coordinator_command(model=open_store(store).root, token=TOKEN, discover=5.0, context_length=64,
                            work_dir=tmp_path / "work", host="127.0.0.1", generate=PROMPT, max_new_tokens=6)
    finally:
        for agent in agents:
            agent.stop()
    ids = tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    want = reference.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)[0]
    out = capsys.readouterr().out
    assert "mdns-agent" in out and out.rstrip().endswith(
        tokenizer.decode(want[ids.shape[1]:], skip_special_tokens=True))


def test_no_agent_found_is_a_clear_error(tmp_path):
    store, _, _ = llama_store_with_tokenizer(tmp_path / "model")
    with pytest.raises(InvalidOption, match="no agents: give --urls, or --discover"):
        coordinator_command(model=store, token=TOKEN, context_length=64, work_dir=tmp_path / "work")
