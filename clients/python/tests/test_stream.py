"""FusedMoEStream through the sync and asyncio clients."""

import asyncio

import numpy as np
import pytest

import expertd
from moeref import rel_l2


def _requests(name, layer, count):
    for i in range(count):
        yield expertd.fused_moe_request(layer.hidden * (1 + i), expert_set=name, output_dtype="float32",
                                        **layer.call_args())


def test_stream_in_order(client, loaded):
    name, layer = loaded
    outs = [r.output for r in client.fused_moe_stream(_requests(name, layer, 6))]
    assert len(outs) == 6
    for i, out in enumerate(outs):
        one = client.fused_moe(layer.hidden * (1 + i), expert_set=name, output_dtype="float32",
                               **layer.call_args())
        np.testing.assert_array_equal(out, one.output)
    assert rel_l2(outs[0], layer.ref) <= 2e-2


def test_stream_dicts_and_error(client, loaded):
    name, layer = loaded
    reqs = [dict(hidden=layer.hidden, expert_set=name, output_dtype="float32", **layer.call_args()),
            dict(hidden=layer.hidden, expert_set="no-such-set", **layer.call_args())]
    it = client.fused_moe_stream(reqs)
    first = next(it)
    assert rel_l2(first.output, layer.ref) <= 2e-2
    with pytest.raises(expertd.ExpertdError) as e:
        list(it)
    assert "no-such-set" in e.value.message


def test_aio_stream(addr, client, loaded):
    name, layer = loaded

    async def go():
        async with expertd.aio.Client(addr) as c:
            return [r.output async for r in c.fused_moe_stream(_requests(name, layer, 4))]

    outs = asyncio.run(go())
    assert len(outs) == 4 and rel_l2(outs[0], layer.ref) <= 2e-2
