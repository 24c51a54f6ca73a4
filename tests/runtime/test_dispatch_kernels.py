"""The token-dispatch kernels agree with their torch references, forward and backward.

Legend: T tokens, K top-k, D hidden size, B buckets, P = T*K permuted rows.

On a machine without CUDA the kernels run in Triton's interpreter (conftest.py decorates them
for it); with CUDA they are compiled and run natively.
"""

import logging

import pytest
import torch

from lazarus_runtime.kernels import backend, bucket_counts, bucket_positions, kernel_backend, permute, unpermute
from lazarus_runtime.kernels.combine import unpermute_reference
from lazarus_runtime.kernels.counts import SLOT_BLOCK, bucket_counts_reference, bucket_positions_reference
from lazarus_runtime.kernels.scatter import permute_reference

# With CUDA the kernels are compiled and CPU tensors take the torch path, so only CUDA tensors
# test the kernels; without it, CPU tensors go through the interpreter.
DEVICES = ["cuda"] if torch.cuda.is_available() else ["cpu"]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}

# (T, K, D, B). With B >= 3 the ids leave bucket B-2 empty and give bucket B-1 one assignment.
SHAPES = [
    (0, 2, 4, 3),  # no tokens
    (1, 1, 1, 1),  # one token, one bucket, hidden size 1
    (5, 2, 1, 4),  # hidden size 1
    (9, 1, 7, 5),  # top-1
    (33, 2, 33, 8),  # hidden size not a power of two
    (70, 2, 3, 3),  # P = 140 spans two slot blocks
    (20, 3, 16, 6),  # top-k not a power of two
    (3, 2, 2100, 4),  # several hidden-size blocks per token
    (11, 8, 1500, 9),  # top-8 with a row wider than one block (DeepSeek-V3's K, scaled down)
]
SHAPE_IDS = [f"T{t}-K{k}-D{d}-B{b}" for t, k, d, b in SHAPES]

pytestmark = pytest.mark.skipif(not backend.HAVE_TRITON, reason="triton is not installed")


@pytest.fixture(autouse=True, scope="module")
def triton_interpreter():
    """Send this module's CPU tensors through the interpreted kernels, and only this module's."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        yield


def make_bucket_ids(num_tokens: int, top_k: int, num_buckets: int, device: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(num_tokens * 1000 + top_k * 10 + num_buckets)
    if num_buckets < 3:
        return torch.randint(0, num_buckets, (num_tokens, top_k), generator=gen).to(device)
    ids_TK = torch.randint(0, num_buckets - 2, (num_tokens, top_k), generator=gen)
    if ids_TK.numel():
        ids_TK.view(-1)[ids_TK.numel() // 2] = num_buckets - 1
    return ids_TK.to(device)


def make_rows(num_tokens: int, top_k: int, num_buckets: int, device: str) -> torch.Tensor:
    ids_TK = make_bucket_ids(num_tokens, top_k, num_buckets, "cpu")
    return bucket_positions_reference(ids_TK, num_buckets)[0].to(device)


def randn(*shape: int, dtype: torch.dtype, device: str, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype).requires_grad_()


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    tol = TOLERANCE[expected.dtype]
    torch.testing.assert_close(actual, expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("device", DEVICES)
def test_the_triton_path_runs(device):
    # Fails if lazarus_runtime.kernels was imported before conftest.py could set TRITON_INTERPRET.
    assert kernel_backend() == "triton"
    assert backend.use_triton(torch.empty(0, device=device))


def test_the_backend_choice_is_logged_once(caplog):
    backend._logged.cache_clear()
    with caplog.at_level(logging.INFO, logger="lazarus.kernels"):
        kernel_backend()
        kernel_backend()
    messages = [r.getMessage() for r in caplog.records if r.name == "lazarus.kernels"]
    assert len(messages) == 1 and messages[0].startswith("token-dispatch kernels use the triton path")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("num_tokens", "top_k", "hidden", "num_buckets"), SHAPES, ids=SHAPE_IDS)
def test_counts_and_slots_match_reference(device, num_tokens, top_k, hidden, num_buckets):
    ids_TK = make_bucket_ids(num_tokens, top_k, num_buckets, device)
    expected_rows_TK, expected_counts_B = bucket_positions_reference(ids_TK.cpu(), num_buckets)
    rows_TK, counts_B = bucket_positions(ids_TK, num_buckets)
    assert rows_TK.dtype == counts_B.dtype == torch.int64
    assert torch.equal(rows_TK.cpu(), expected_rows_TK)
    assert torch.equal(counts_B.cpu(), expected_counts_B)
    assert torch.equal(bucket_counts(ids_TK, num_buckets).cpu(), bucket_counts_reference(ids_TK.cpu(), num_buckets))


@pytest.mark.parametrize("device", DEVICES)
def test_slots_are_contiguous_per_bucket_in_token_order(device):
    # Uneven buckets over three slot blocks, so block boundaries fall inside buckets.
    num_buckets = 7
    gen = torch.Generator().manual_seed(0)
    ids_TK = torch.multinomial(torch.tensor([8.0, 0, 1, 4, 2, 0, 1]), 2 * 150, True, generator=gen).view(150, 2)
    rows_TK, counts_B = bucket_positions(ids_TK.to(device), num_buckets)
    ids_P, rows_P, counts_B = ids_TK.view(-1), rows_TK.cpu().view(-1), counts_B.cpu()
    assert ids_P.numel() > 2 * SLOT_BLOCK
    assert torch.equal(torch.sort(rows_P).values, torch.arange(ids_P.numel()))
    offsets_B = torch.cumsum(counts_B, 0) - counts_B
    for b in range(num_buckets):
        # Flattened order t*K + k within the bucket maps to consecutive rows from offsets[b].
        rows_in_bucket = rows_P[ids_P == b]
        assert torch.equal(rows_in_bucket, offsets_B[b] + torch.arange(int(counts_B[b])))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("num_tokens", "top_k", "hidden", "num_buckets"), SHAPES, ids=SHAPE_IDS)
def test_permute_matches_reference(device, dtype, num_tokens, top_k, hidden, num_buckets):
    rows_TK = make_rows(num_tokens, top_k, num_buckets, device)
    x_TD = randn(num_tokens, hidden, dtype=dtype, device=device, seed=1)
    grad_PD = randn(num_tokens * top_k, hidden, dtype=dtype, device=device, seed=2).detach()

    out_PD = permute(x_TD, rows_TK)
    expected_PD = permute_reference(x_TD, rows_TK)
    assert torch.equal(out_PD, expected_PD)  # a copy: exact
    (grad_x,) = torch.autograd.grad(out_PD, x_TD, grad_PD)
    # The kernel sums a token's K gradients in fp32, as the reference does only in fp32 (in
    # half precision it accumulates in half, which at top-8 drifts by more than a rounding).
    x32_TD = x_TD.detach().float().requires_grad_()
    (expected_grad_x,) = torch.autograd.grad(permute_reference(x32_TD, rows_TK), x32_TD, grad_PD.float())
    assert_close(grad_x, expected_grad_x.to(dtype))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("num_tokens", "top_k", "hidden", "num_buckets"), SHAPES, ids=SHAPE_IDS)
def test_unpermute_matches_reference(device, dtype, num_tokens, top_k, hidden, num_buckets):
    rows_TK = make_rows(num_tokens, top_k, num_buckets, device)
    y_PD = randn(num_tokens * top_k, hidden, dtype=dtype, device=device, seed=3)
    weights_TK = randn(num_tokens, top_k, dtype=dtype, device=device, seed=4)
    grad_TD = randn(num_tokens, hidden, dtype=dtype, device=device, seed=5).detach()

    out_TD = unpermute(y_PD, rows_TK, weights_TK)
    expected_TD = unpermute_reference(y_PD, rows_TK, weights_TK)
    assert_close(out_TD, expected_TD)
    grads = torch.autograd.grad(out_TD, (y_PD, weights_TK), grad_TD)
    expected_grads = torch.autograd.grad(expected_TD, (y_PD, weights_TK), grad_TD)
    for grad, expected in zip(grads, expected_grads):
        assert_close(grad, expected)


@pytest.mark.parametrize("device", DEVICES)
def test_unpermute_keeps_each_tensors_dtype(device):
    # Gates often stay fp32 while activations are bf16.
    rows_TK = make_rows(6, 2, 4, device)
    y_PD = randn(12, 8, dtype=torch.bfloat16, device=device, seed=6)
    weights_TK = randn(6, 2, dtype=torch.float32, device=device, seed=7)
    out_TD = unpermute(y_PD, rows_TK, weights_TK)
    assert_close(out_TD, unpermute_reference(y_PD, rows_TK, weights_TK))
    grad_y, grad_weights = torch.autograd.grad(out_TD.float().sum(), (y_PD, weights_TK))
    assert (grad_y.dtype, grad_weights.dtype) == (torch.bfloat16, torch.float32)


@pytest.mark.parametrize("device", DEVICES)
def test_strided_inputs(device):
    rows_TK = make_rows(10, 2, 4, device)
    x_TD = randn(6, 10, dtype=torch.float32, device=device, seed=8).t()
    weights_TK = randn(2, 10, dtype=torch.float32, device=device, seed=9).t()
    assert torch.equal(permute(x_TD, rows_TK), permute_reference(x_TD, rows_TK))
    y_PD = randn(6, 20, dtype=torch.float32, device=device, seed=10).t()
    assert_close(unpermute(y_PD, rows_TK, weights_TK), unpermute_reference(y_PD, rows_TK, weights_TK))


IDS = torch.tensor([[0, 1], [2, 0]])
ROWS = torch.tensor([[0, 2], [3, 1]])
X = torch.ones(2, 3)
Y = torch.ones(4, 3)
W = torch.ones(2, 2)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: bucket_counts(IDS.float(), 3), "bucket_ids_TK must be int64"),
        (lambda: bucket_counts(IDS.view(-1), 3), r"must be 2-D \[tokens, top_k\]"),
        (lambda: bucket_counts(IDS[:, :0], 3), "top_k >= 1"),
        (lambda: bucket_counts(IDS, 0), "num_buckets must be a positive int"),
        (lambda: bucket_positions(IDS, 2), r"bucket_ids_TK must lie in \[0, 2\), found values in \[0, 2\]"),
        (lambda: bucket_positions(IDS - 1, 3), r"must lie in \[0, 3\), found values in \[-1, 1\]"),
        (lambda: permute(X, ROWS.int()), "rows_TK must be int64"),
        (lambda: permute(X, ROWS + 1), r"rows_TK must lie in \[0, 4\)"),
        (lambda: permute(X[:1], ROWS), "x_TD must have 2 rows"),
        (lambda: permute(X.long(), ROWS), "x_TD must be float32, float16 or bfloat16"),
        (lambda: permute(X.double(), ROWS), "x_TD must be float32, float16 or bfloat16"),
        (lambda: permute(X.view(-1), ROWS), "x_TD must be 2-D"),
        (lambda: unpermute(Y[:3], ROWS, W), "y_PD must have 4 rows"),
        (lambda: unpermute(Y, ROWS, W[:, :1]), "weights_TK must have the shape of rows_TK"),
        (lambda: unpermute(Y, ROWS, W.long()), "weights_TK must be float32"),
    ],
)
def test_bad_arguments_raise_value_error(call, message):
    with pytest.raises(ValueError, match=message):
        call()
