"""The asyncio client against a real daemon."""

import asyncio

import numpy as np
import pytest

import expertd
from moeref import rel_l2


def test_aio_round_trip(addr, layer):
    async def go():
        async with expertd.aio.Client(addr) as c:
            info = await c.server_info()
            assert info.version
            await c.load_experts("pytest-aio", *layer.weights(), overwrite=True)
            try:
                assert "pytest-aio" in [s.name for s in await c.list_experts()]
                # Concurrent calls on one channel.
                outs = await asyncio.gather(*[
                    c.fused_moe(layer.hidden, expert_set="pytest-aio", output_dtype="float32", **layer.call_args())
                    for _ in range(8)])
                with pytest.raises(expertd.NotFoundError):
                    await c.fused_moe(layer.hidden, expert_set="no-such-set", **layer.call_args())
            finally:
                assert await c.unload_experts("pytest-aio") > 0
            return outs

    outs = asyncio.run(go())
    for o in outs:
        np.testing.assert_array_equal(o.output, outs[0].output)
    assert rel_l2(outs[0].output, layer.ref) <= 2e-2
