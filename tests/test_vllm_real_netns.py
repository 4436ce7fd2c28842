"""Real vLLM P and D on two hosts: each server in a network namespace of its own, over TCP.

The namespaces hang on one bridge in the test's namespace (`BridgedHosts`), where the router and
the reference engine run; P and D reach each other only across the bridge.  kvflow's control
plane binds each server's own address, so it needs a secret (the launcher writes one into the
run folder), and NIXL's UCX is held to TCP on the server's interface (``UCX_TLS=tcp``,
``UCX_NET_DEVICES``): no shared memory between the two engines.  Every request's greedy tokens
on D equal the reference's, D's counters say the KV came by transfer, and P's interface sent at
least the KV's bytes (a lower bound; nothing else P sends is nearly as large).  Needs root;
skips, saying why, where network namespaces cannot be created.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvflow_tools.netns import BridgedHosts, unavailable
from kvflow_tools.serve.launcher import Deployment, Host, ServeOptions
from kvflow_tools.serve.tiny_model import TinyModel
from tests.vllm_real import BLOCK, PREFILL_BUDGET, asking, prompts, reference, running, transferred

REASON = unavailable()
pytestmark = [
    pytest.mark.timeout(1200),
    pytest.mark.real_engine,
    pytest.mark.skipif(REASON is not None, reason=f"two hosts need network namespaces: {REASON}"),
]

SERVERS = {"prefill-0": "p", "decode-0": "d"}  # server -> its host


def kv_bytes_per_token(model: TinyModel, dtype_bytes: int = 4) -> int:
    """K and V of every layer for one token (the launcher's default model, float32)."""
    return model.num_layers * 2 * model.num_kv_heads * model.head_dim * dtype_bytes


@pytest.fixture(scope="module")
def hosts() -> Iterator[BridgedHosts]:
    with BridgedHosts(list(SERVERS.values())) as made:
        yield made


@pytest.fixture(scope="module")
def pd(hosts: BridgedHosts, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    placed = {
        server: Host(
            hosts.address(host),
            tuple(hosts.command(host)),
            {"UCX_TLS": "tcp", "UCX_NET_DEVICES": hosts.device(host)},
        )
        for server, host in SERVERS.items()
    }
    options = ServeOptions(
        reference=True,
        port=0,
        block_size=BLOCK,
        max_model_len=2048,
        prefill_batched_tokens=PREFILL_BUDGET,
        kvflow_settings={"lease": 15.0, "transfer_timeout": 40.0},
        run_dir=tmp_path_factory.mktemp("real-netns"),
        hosts=placed,
    )
    yield from running(options)


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_p_and_d_on_two_hosts_move_the_kv_over_tcp_and_d_decodes_one_engines_tokens(
    pd: Deployment, hosts: BridgedHosts, mode: str
) -> None:
    p, d = pd.server("prefill-0"), pd.server("decode-0")
    assert p.url.startswith(f"http://{hosts.address('p')}:") and p.kvflow.startswith(f"tcp://{hosts.address('p')}:")
    assert d.kvflow.startswith(f"tcp://{hosts.address('d')}:")
    router = pd.add_router(mode)
    # a prompt under a block, one over several blocks, one chunked by P's token budget
    for prompt in prompts({"push": 11, "pull": 12}[mode], [7, 3 * BLOCK + 5, PREFILL_BUDGET + 2 * BLOCK + 1]):
        want = reference(pd, prompt)
        sent = hosts.sent_bytes("p")
        transferred(pd, asking(router, prompt, want), len(prompt))
        assert hosts.sent_bytes("p") - sent >= len(prompt) * kv_bytes_per_token(TinyModel())
