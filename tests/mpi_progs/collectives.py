"""Run under mpirun: checks every MPIComm collective against the values each rank can compute alone."""
import numpy as np

from ddtree_cupy.bf16 import bf16_bits_to_f32, to_bf16_bits
from ddtree_cupy.dist import MPIComm, init_communicator

c = init_communicator("numpy")
assert isinstance(c, MPIComm), type(c)
n = c.size
rng = np.random.default_rng(1234)
parts = rng.standard_normal((n, 7, 5))           # every rank draws the same table, contributes its row
x = parts[c.rank].copy()
c.all_reduce(x)
np.testing.assert_allclose(x, parts.sum(0), rtol=1e-12)
xf = parts[c.rank].astype(np.float32)
c.all_reduce(xf)
np.testing.assert_allclose(xf, parts.sum(0), rtol=1e-5)
xb = to_bf16_bits(parts[c.rank])
c.all_reduce(xb)
want = bf16_bits_to_f32(to_bf16_bits(bf16_bits_to_f32(to_bf16_bits(parts)).sum(0)))
np.testing.assert_array_equal(bf16_bits_to_f32(xb), want)
g = c.all_gather(np.full(3, c.rank, dtype=np.int32))
assert g.shape == (n, 3) and (g == np.arange(n)[:, None]).all(), g
obj = c.broadcast_obj({"req": [1, 2, 3], "from": c.rank}, root=0)
assert obj == {"req": [1, 2, 3], "from": 0}, obj
c.barrier()
print(f"rank {c.rank}/{n} OK", flush=True)
