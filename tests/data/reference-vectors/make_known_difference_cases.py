# Dumps lfq_d10_c1024_entropy_commit and vq_diversity_ema (the per-term
# tolerance and known-difference cases, issue 20 items 10 and 12) into the
# folder given as the first argument. Run with vector-quantize-pytorch 1.32.0,
# PyTorch 2.14.1 (CPU) and safetensors 0.8.0:
#   python3 make_known_difference_cases.py tests/data/reference-vectors
import json, sys, torch, platform
from safetensors.torch import save_file
import vector_quantize_pytorch as vqp
from vector_quantize_pytorch import VectorQuantize, LFQ
torch.set_num_threads(1)
out = sys.argv[1]
LOSS = ("L = sum(quantized * w) + sum(aux_loss), where aux_loss is the auxiliary loss exactly as "
        "returned by forward (summed over all its elements when it is a vector); x_grad = dL/dx "
        "and <param>_grad = dL/d<param>, from one backward pass")

def stored(t):
    t = t.detach().clone()
    return t.to(torch.uint8) if t.dtype == torch.bool else t

def dump(name, cls, mod, opts, shape, seeds, fwd_kwargs, note, margin):
    tensors = {k: stored(v) for k, v in mod.state_dict().items()}
    for attempt in range(200):
        x = torch.randn(shape, generator=torch.Generator().manual_seed(seeds[1] + 1000 * attempt))
        if margin(mod, x): break
    else:
        raise SystemExit("no input clear of decision boundaries")
    mod.load_state_dict({k: v for k, v in tensors.items()}, strict=False)
    x = x.clone().requires_grad_()
    ret = mod(x, **fwd_kwargs)
    if len(ret) == 2:  # LFQ: (Return(quantized, indices, aux_loss), breakdown)
        (quantized, indices, aux_loss), breakdown = ret
    else:
        quantized, indices, aux_loss, breakdown = ret
    w = torch.randn(quantized.shape, generator=torch.Generator().manual_seed(seeds[2]))
    L = (quantized * w).sum() + aux_loss.sum()
    L.backward()
    tensors.update(x=stored(x), w=w, quantized=stored(quantized), indices=indices,
                   aux_loss=stored(aux_loss), L=stored(L), x_grad=x.grad)
    for n, value in breakdown._asdict().items():
        tensors[f"aux_loss.{n}"] = torch.as_tensor(value, dtype=torch.float32).detach()
    if cls == "VectorQuantize":
        for k, v in mod.state_dict().items():
            if "_codebook." in k:
                tensors[k + "_after"] = stored(v)
    for k, p in mod.named_parameters():
        if p.grad is not None:
            tensors[k + "_grad"] = p.grad
    spec = {"case": name, "kind": "forward_backward", "class": cls,
            "module": "vector_quantize_pytorch." + cls, "constructor_options": opts,
            "mode": "train", "forward_kwargs": {k: v for k, v in fwd_kwargs.items()},
            "loss": LOSS, "x_grad_defined": True, "state_aliases": {},
            "randomness": {"module_init": f"torch.manual_seed({seeds[0]}) then construct",
                           "x": f"torch.randn(shape, generator=torch.Generator().manual_seed({seeds[1]} + 1000 * attempt)), attempt {attempt}",
                           "w": f"torch.randn(quantized.shape, generator=torch.Generator().manual_seed({seeds[2]}))"},
            "note": note,
            "peer": {"vector_quantize_pytorch": "1.32.0", "torch": torch.__version__,
                     "python": platform.python_version(), "device": "cpu", "dtype": "float32",
                     "threads": 1}}
    metadata = {"case": name, "kind": "forward_backward", "class": cls, "mode": "train",
                "loss": LOSS, "library_version": "vector-quantize-pytorch 1.32.0",
                "torch_version": torch.__version__, "format": "safetensors; reference vectors v1",
                "spec": json.dumps(spec)}
    save_file({k: v.detach().contiguous().clone() for k, v in tensors.items()},
              f"{out}/{name}.safetensors", metadata=metadata)
    print(name, "attempt", attempt, {k: tuple(v.shape) for k, v in tensors.items()})

# LFQ: every value at least 2e-4 * rms from zero (the README's margin).
def lfq_margin(m, x):
    return bool((x.abs() >= 2e-4 * x.pow(2).mean().sqrt()).all())

opts = dict(dim=10, codebook_size=1024, entropy_loss_weight=0.1, commitment_loss_weight=0.25,
            diversity_gamma=1.0, frac_per_sample_entropy=1.0)
torch.manual_seed(1001)
m = LFQ(**opts).train()
dump("lfq_d10_c1024_entropy_commit", "LFQ", m, opts, (2, 16, 10), (1001, 1002, 1003),
     {"return_loss_breakdown": True, "inv_temperature": 100.0},
     "entropy over 1024 codes: float32 rounding of the entropy terms reaches ~1e-5 relative, "
     "so the runner compares them at 1e-4", lfq_margin)

# VQ with the codebook diversity loss and the EMA update on: x_grad differs (known difference).
def vq_margin(m, x):
    e = m._codebook.embed[0].detach().double()
    xd = x.reshape(-1, x.shape[-1]).double()
    d = (xd.pow(2).sum(-1, keepdim=True) + e.pow(2).sum(-1) - 2 * xd @ e.T)
    s = d.sort(-1).values
    scale = xd.pow(2).sum(-1) + e.pow(2).sum(-1).max()
    return bool(((s[:, 1] - s[:, 0]) >= 5e-5 * scale).all())

opts = dict(dim=16, codebook_size=32, decay=0.8, eps=1e-5, commitment_weight=1.0,
            codebook_diversity_loss_weight=0.5, kmeans_init=False, threshold_ema_dead_code=0,
            stochastic_sample_codes=False)
torch.manual_seed(1011)
m = VectorQuantize(**opts).train()
dump("vq_diversity_ema", "VectorQuantize", m, opts, (2, 12, 16), (1011, 1012, 1013),
     {"return_loss_breakdown": True},
     "codebook_diversity_loss_weight with the EMA update on: the reference's x_grad reads the "
     "post-update codebook (a known difference, docs/vq.md)", vq_margin)
