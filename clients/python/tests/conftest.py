"""Fixtures of the tests against a real daemon. EXPERTD_ADDR names it
(e2e/python_test.go starts one and sets it); without it every test that
needs a daemon skips. EXPERTD_SHM=1 says the daemon serves shared memory;
EXPERTD_CUDA=1 that it runs the cuda backend on this host's GPU.
EXPERTD_RING_ADDR names a second daemon with -shared-memory -ring, and
EXPERTD_PLAIN_ADDR a third with neither (the tests of RemoteMoE's path
choice; they skip without them)."""

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))

import moeref  # noqa: E402

import expertd  # noqa: E402


@pytest.fixture(scope="session")
def addr():
    a = os.environ.get("EXPERTD_ADDR")
    if not a:
        pytest.skip("EXPERTD_ADDR is not set: no daemon to test against")
    return a


@pytest.fixture
def client(addr):
    with expertd.Client(addr) as c:
        yield c


def _client_of(env):
    a = os.environ.get(env)
    if not a:
        pytest.skip(f"{env} is not set: no such daemon to test against")
    return expertd.Client(a)


@pytest.fixture
def ring_client():
    """A client of the daemon run with -shared-memory -ring."""
    with _client_of("EXPERTD_RING_ADDR") as c:
        yield c


@pytest.fixture
def plain_client():
    """A client of the daemon run without -shared-memory."""
    with _client_of("EXPERTD_PLAIN_ADDR") as c:
        yield c


@pytest.fixture
def rng(request):
    seed = int(os.environ.get("EXPERTD_TEST_SEED", "0")) or np.random.SeedSequence().entropy % (1 << 32)
    print(f"seed {seed} (EXPERTD_TEST_SEED={seed} repeats it)")
    return np.random.default_rng(seed)


class Layer:
    """A random gated layer and one batch of inputs with its reference."""

    def __init__(self, rng, e=8, k=64, n=32, m=5, top_k=2):
        self.e, self.k, self.n, self.m, self.top_k = e, k, n, m, top_k
        self.w13, self.w2, self.s13, self.s2 = moeref.random_layer(rng, e, k, n)
        self.hidden = (rng.standard_normal((m, k)) / 10).astype(np.float32)
        self.logits = rng.standard_normal((m, e)).astype(np.float32)
        self.ref = self.ref_of(self.hidden)

    def ref_of(self, hidden):
        """The reference for hidden states as the daemon receives them: a
        caller sending BF16 gets the FP8 quantization of the BF16 values,
        whose per-row scales differ from the float32 ones, so its reference
        is computed from the rounded values."""
        ids, w = moeref.route(self.logits, self.top_k, True)
        return moeref.fused_moe(hidden, self.w13, self.w2, self.s13, self.s2, ids, w)

    def weights(self):
        return (self.w13, self.w2, self.s13, self.s2)

    def call_args(self):
        return dict(router_logits=self.logits, top_k=self.top_k, renormalize=True)


@pytest.fixture
def layer(rng):
    return Layer(rng)


@pytest.fixture
def loaded(client, layer, request):
    name = "pytest-" + request.node.name.replace("[", "-").replace("]", "")[:60]
    client.load_experts(name, *layer.weights(), overwrite=True)
    yield name, layer
    try:
        client.unload_experts(name)
    except expertd.NotFoundError:
        pass
