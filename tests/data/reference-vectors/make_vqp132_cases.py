# Dumps the vector-quantize-pytorch 1.32 cases (DiVeQ, quant_grad_frac, masks
# with the 1.32 output rule, partial dead-code replacement, top-k codes,
# ResidualVQ beam search, manual_ema_update, LatentQuantize, FSP, FVQ's
# vq_bridge, QINCo's implicit neural codebook, HierarchicalVQ) into the folder given as the
# first argument; further arguments name the only cases to write. Run with
# vector-quantize-pytorch 1.32.0, PyTorch 2.14.1 (CPU) and safetensors 0.8.0:
#   python3 make_vqp132_cases.py tests/data/reference-vectors [case ...]
# Random draws the reference makes inside a forward are handled as the
# README's "Random draws inside a forward" says: DiVeQ's noise is recorded
# (draws.directional_noise) for quanta parity to replay; the dead-code
# choice is not, and its case stores no tensor that depends on it.
import copy, json, sys, platform
import torch
from safetensors.torch import save_file
from vector_quantize_pytorch import VectorQuantize, ResidualVQ, LatentQuantize, FSP
from vector_quantize_pytorch.hierarchical_vq import HierarchicalVQ
torch.set_num_threads(1)
out = sys.argv[1]
ONLY = set(sys.argv[2:])  # empty: every case
LOSS = ("L = sum(quantized * w) + sum(aux_loss), where aux_loss is the auxiliary loss exactly as "
        "returned by forward (summed over all its elements when it is a vector); x_grad = dL/dx "
        "and <param>_grad = dL/d<param>, from one backward pass")

def stored(t):
    t = t.detach().clone()
    return t.to(torch.uint8) if t.dtype == torch.bool else t

class Record:
    """Records every call of torch.<fn> (randn_like, rand_like) inside the block."""
    def __init__(self, fn):
        self.fn = fn
    def __enter__(self):
        self.draws, self.orig = [], getattr(torch, self.fn)
        def recorded(t, *a, **k):
            r = self.orig(t, *a, **k)
            self.draws.append(r.detach().clone())
            return r
        setattr(torch, self.fn, recorded)
        return self
    def __exit__(self, *exc):
        setattr(torch, self.fn, self.orig)

def codebooks(m):
    """(codebook [K, d] float64, projection or None) per quantizing layer, in order."""
    layers = list(m.layers) if isinstance(m, ResidualVQ) else [m]
    proj = m.project_in if getattr(m, "has_projections", False) else None
    return [l._codebook.embed[0].detach().double() for l in layers], proj

def margin_ok(m, x, mask, rel=5e-5):
    """Every valid token's nearest code (at every residual layer, in float64)
    is ahead of the second by rel * scale: no decision sits on a boundary."""
    embeds, proj = codebooks(m)
    r = x.detach()
    if proj is not None:
        r = torch.nn.functional.linear(r, proj.weight, proj.bias)
    r = r.double().reshape(-1, r.shape[-1])
    if mask is not None:
        r = r[mask.reshape(-1)]
    for e in embeds:
        d = r.pow(2).sum(-1, keepdim=True) + e.pow(2).sum(-1) - 2 * r @ e.T
        s = d.sort(-1)
        scale = r.pow(2).sum(-1) + e.pow(2).sum(-1).max()
        if not ((s.values[:, 1] - s.values[:, 0]) >= rel * scale).all():
            return False
        r = r - e[s.indices[:, 0]]
    return True

def latent_margin_ok(m, x, mask, rel=1e-4):
    """Every projected value is clear of the midpoint between grid values."""
    z = x.detach().movedim(1, -1)
    if m.has_projections:
        z = m.project_in(z)
    z = z.reshape(*z.shape[:-1], m.num_codebooks, -1).double()
    for i, v in enumerate(m.values_per_latent):
        d = (z[..., i, None] - v.detach().double()).abs().sort(-1).values
        if not ((d[..., 1] - d[..., 0]) >= rel).all():
            return False
    return True

def dump(name, cls, ctor, opts, shape, seeds, note, mask_rows=None, after=True, drop=(),
         mode="train", extra=None, margin=margin_ok, param_grads=True):
    if ONLY and name not in ONLY:
        return
    torch.manual_seed(seeds[0])
    mod = ctor(**opts).train(mode == "train")
    tensors = {k: stored(v) for k, v in mod.state_dict().items()}
    mask = None
    if mask_rows is not None:
        mask = torch.tensor(mask_rows, dtype=torch.bool)
    for attempt in range(200):
        x = torch.randn(shape, generator=torch.Generator().manual_seed(seeds[1] + 1000 * attempt))
        if margin(mod, x, mask): break
    else:
        raise SystemExit(name + ": no input clear of decision boundaries")
    x = x.clone().requires_grad_()
    kwargs = {}
    if cls == "VectorQuantize":
        kwargs["return_loss_breakdown"] = True
    if mask is not None:
        kwargs["mask"] = mask
    kwargs.update(extra or {})
    with Record("randn_like") as normals, Record("rand_like") as uniforms:
        ret = mod(x, **kwargs)
    quantized, indices, aux_loss = ret[:3]
    w = torch.randn(quantized.shape, generator=torch.Generator().manual_seed(seeds[2]))
    L = (quantized * w).sum() + aux_loss.sum()
    if L.requires_grad:
        L.backward()
    x_grad = x.grad if x.grad is not None else torch.zeros_like(x)
    tensors.update(getattr(mod, "recorded_draws", {}))
    tensors.update(x=stored(x), w=w, quantized=stored(quantized), indices=indices,
                   aux_loss=stored(aux_loss), L=stored(L), x_grad=x_grad)
    if mask is not None:
        tensors["token_mask"] = stored(mask)
    if len(ret) == 4 and isinstance(ret[3], dict):  # FSP: level indices and acceptance
        tensors["level_indices"] = ret[3]["level_indices"].to(torch.int32)
        if "p_accept_prob" in ret[3]:
            tensors["aux_loss.p_accept_prob"] = ret[3]["p_accept_prob"].detach().float()
    elif len(ret) == 4:
        for n, value in ret[3]._asdict().items():
            tensors[f"aux_loss.{n}"] = torch.as_tensor(value, dtype=torch.float32).detach()
    assert len(uniforms.draws) in (0, 2), "FSP draws twice or not at all"
    for what, u in zip(("perturbation", "keep"), uniforms.draws):
        tensors["draws." + what] = u
    assert len(normals.draws) <= 1, "one normal draw expected inside the forward"
    if normals.draws:
        tensors["draws.directional_noise"] = normals.draws[0]
    if after:
        for k, v in mod.state_dict().items():
            if "_codebook." in k:
                tensors[k + "_after"] = stored(v)
    for k, p in mod.named_parameters():
        if param_grads and p.grad is not None:
            tensors[k + "_grad"] = p.grad
    for k in drop:
        tensors.pop(k, None)
    fwd = {k: (v if not torch.is_tensor(v) else {"tensor": "token_mask"}) for k, v in kwargs.items()}
    spec = {"case": name, "kind": "forward_backward", "class": cls,
            "module": "vector_quantize_pytorch." + cls, "constructor_options": opts,
            "mode": mode, "forward_kwargs": fwd,
            "loss": LOSS, "x_grad_defined": True, "state_aliases": {},
            "randomness": {"module_init": f"torch.manual_seed({seeds[0]}) then construct",
                           "x": f"torch.randn(shape, generator=torch.Generator().manual_seed({seeds[1]} + 1000 * attempt)), attempt {attempt}",
                           "w": f"torch.randn(quantized.shape, generator=torch.Generator().manual_seed({seeds[2]}))"},
            "note": note,
            "peer": {"vector_quantize_pytorch": "1.32.0", "torch": torch.__version__,
                     "python": platform.python_version(), "device": "cpu", "dtype": "float32",
                     "threads": 1}}
    metadata = {"case": name, "kind": "forward_backward", "class": cls, "mode": mode,
                "loss": LOSS, "library_version": "vector-quantize-pytorch 1.32.0",
                "torch_version": torch.__version__, "format": "safetensors; reference vectors v1",
                "spec": json.dumps(spec)}
    save_file({k: v.detach().contiguous().clone() for k, v in tensors.items()},
              f"{out}/{name}.safetensors", metadata=metadata)
    print(name, "attempt", attempt, {k: tuple(v.shape) for k, v in tensors.items()})

BASE = dict(decay=0.8, eps=1e-5, kmeans_init=False, stochastic_sample_codes=False)
# A 2 x 12 batch: tokens 9.. of the first row and 5.. of the second are padding.
MASK = [[True] * 9 + [False] * 3, [True] * 5 + [False] * 7]

# DiVeQ: codes learn by gradient through the reparameterised output; no EMA,
# no commitment loss; dead-code replacement on (required), which one step
# cannot reach (cluster sizes start at 1, decay 0.8, threshold 0.5).
dump("vq_diveq", "VectorQuantize", VectorQuantize,
     dict(dim=16, codebook_size=32, directional_reparam=True, threshold_ema_dead_code=0.5, **BASE),
     (2, 12, 16), (1101, 1102, 1103),
     "DiVeQ (directional_reparam): the output moves x by |q - x| along the noisy error "
     "direction; draws.directional_noise holds the reference's randn_like draw")
dump("rvq_q3_diveq_proj", "ResidualVQ", ResidualVQ,
     dict(dim=16, codebook_dim=8, num_quantizers=3, codebook_size=32, diveq=True,
          threshold_ema_dead_code=0, **BASE),
     (2, 12, 16), (1111, 1112, 1113),
     "ResidualVQ diveq=True: learnable codes, full residual gradient, the summed output "
     "reparameterised against the projected input (draws.directional_noise)")
dump("rvq_q3_grad_frac", "ResidualVQ", ResidualVQ,
     dict(dim=16, num_quantizers=3, codebook_size=32, quant_grad_frac=0.5, commitment_weight=1.0,
          threshold_ema_dead_code=0, **BASE),
     (2, 12, 16), (1121, 1122, 1123),
     "quant_grad_frac=0.5: half of the later layers' gradient reaches each layer's output")
dump("rvq_q2_masked_proj", "ResidualVQ", ResidualVQ,
     dict(dim=16, codebook_dim=8, num_quantizers=2, codebook_size=32, commitment_weight=1.0,
          threshold_ema_dead_code=0, **BASE),
     (2, 12, 16), (1131, 1132, 1133),
     "mask with projections: 1.32 outputs zeros at padding after project_out", mask_rows=MASK)
dump("rvq_q2_masked_keep_input", "ResidualVQ", ResidualVQ,
     dict(dim=16, codebook_dim=8, num_quantizers=2, codebook_size=32, commitment_weight=1.0,
          return_zeros_for_masked_padding=False, threshold_ema_dead_code=0, **BASE),
     (2, 12, 16), (1141, 1142, 1143),
     "return_zeros_for_masked_padding=False: padding outputs the input unchanged", mask_rows=MASK)
# (Without projections: the reference's masked commitment loss compares the
# codes with the unprojected input, which fails with codebook_dim != dim.)
dump("vq_masked_keep_input", "VectorQuantize", VectorQuantize,
     dict(dim=16, codebook_size=32, commitment_weight=1.0,
          return_zeros_for_masked_padding=False, threshold_ema_dead_code=0, **BASE),
     (2, 12, 16), (1151, 1152, 1153),
     "VectorQuantize with a mask and return_zeros_for_masked_padding=False", mask_rows=MASK)
# 1.32's partial dead-code replacement: 6 tokens, 32 codes, threshold 0.9 >
# 0.8 (an unused code's cluster size after one step), so at least 26 codes
# expire and only 6, chosen at random, are replaced. Which ones depends on
# the reference's draws, so the case stores only what does not: the
# forward, its losses and gradients, and cluster_size before the expiry
# cannot be compared either, so no _after tensor is stored.
dump("vq_dead_codes_partial", "VectorQuantize", VectorQuantize,
     dict(dim=16, codebook_size=32, commitment_weight=1.0, threshold_ema_dead_code=0.9, **BASE),
     (1, 6, 16), (1161, 1162, 1163),
     "more expired codes than samples: 1.32 replaces a random subset (not stored: it depends "
     "on the reference's draws; quanta's tests check the rule)", after=False)

# topk codes: the 3 nearest codes of every token, per-token losses, no
# codebook update (the caller keeps some codes); in training and in eval.
for mode in ("train", "eval"):
    dump(f"vq_topk3_{mode}", "VectorQuantize", VectorQuantize,
         dict(dim=16, codebook_size=32, commitment_weight=1.0, threshold_ema_dead_code=0, **BASE),
         (2, 12, 16), (1171, 1172, 1173),
         f"forward(topk=3) in {mode} mode: quantized [b, n, 3, d], per-token losses [b, n, 3]",
         mode=mode, extra={"topk": 3})
# ResidualVQ beam search: greedy choices replaced by the best of beam_size
# paths per token; the codebooks then take the best path's statistics.
dump("rvq_q3_beam2", "ResidualVQ", ResidualVQ,
     dict(dim=16, num_quantizers=3, codebook_size=32, beam_size=2, commitment_weight=1.0,
          threshold_ema_dead_code=0, **BASE),
     (2, 12, 16), (1181, 1182, 1183), "beam_size=2 in training")
dump("rvq_q3_beam3_weights_masked", "ResidualVQ", ResidualVQ,
     dict(dim=16, num_quantizers=3, codebook_size=32, beam_size=3, commitment_weight=1.0,
          beam_score_quantizer_weights=[1.0, 0.5, 0.25], threshold_ema_dead_code=0, **BASE),
     (2, 12, 16), (1191, 1192, 1193),
     "beam_size=3, per-layer score weights, a mask (1.32's loss normaliser: all valid tokens)",
     mask_rows=MASK)
dump("rvq_q3_eval_beam4_proj", "ResidualVQ", ResidualVQ,
     dict(dim=16, codebook_dim=8, num_quantizers=3, codebook_size=32, beam_size=2,
          eval_beam_size=4, commitment_weight=1.0, threshold_ema_dead_code=0, **BASE),
     (2, 12, 16), (1201, 1202, 1203), "eval_beam_size=4 in eval mode, with projections",
     mode="eval")
# LatentQuantize, channel-first feature maps [b, d, h, w] (the reference's
# only layout): one codebook, and two codebooks with projections (1.32 builds
# num_codebooks > 1; even levels start at -1/2 with 0 on the grid).
dump("latent_555", "LatentQuantize", LatentQuantize,
     dict(levels=[5, 5, 5], dim=3), (2, 3, 3, 4), (1211, 1212, 1213),
     "LatentQuantize levels [5, 5, 5] on a [2, 3, 3, 4] feature map", margin=latent_margin_ok)
dump("latent_534_c2_proj", "LatentQuantize", LatentQuantize,
     dict(levels=[5, 3, 4], dim=8, num_codebooks=2), (2, 8, 3, 4), (1221, 1222, 1223),
     "LatentQuantize levels [5, 3, 4], num_codebooks=2, projections 8 -> 6 -> 8",
     margin=latent_margin_ok)
# manual_ema_update: the forward's EMA step moves cluster_size and embed_avg,
# the codes wait for update_ema().
dump("vq_manual_ema", "VectorQuantize", VectorQuantize,
     dict(dim=16, codebook_size=32, commitment_weight=1.0, manual_ema_update=True,
          threshold_ema_dead_code=0, **BASE),
     (2, 12, 16), (1231, 1232, 1233), "manual_ema_update=True: embed unchanged after the step")

def fsp_margin_ok(m, x, mask, rel=1e-4):
    """Every activation is clear of its bin edges (in float64)."""
    z = x.detach().movedim(1, -1) if m.channel_first else x.detach()
    z = z.reshape(-1, m.dim)
    if m.has_projections:
        z = m.project_in(z)
    a = m.act_func(z.double()) * m._levels.double()
    return bool(((a - a.round()).abs() >= rel).all())

# FSP: the training perturbation replays the reference's two rand_like draws
# (draws.perturbation, draws.keep); level indices as int32.
dump("fsp_8555", "FSP", FSP, dict(levels=[8, 5, 5, 5]), (2, 16, 4), (1241, 1242, 1243),
     "FSP defaults (tanh, quantize_rate 0: every element perturbed in training, var_tanh)",
     margin=fsp_margin_ok)
dump("fsp_865_d12_normal_inv", "FSP", FSP,
     dict(levels=[8, 6, 5], dim=12, act_name="normal", need_inv_act=True, quantize_rate=0.5,
          vector_norm="kurt"),
     (2, 16, 12), (1251, 1252, 1253),
     "normal CDF, the inverse activation as the code, half the elements quantized, kurtosis loss",
     margin=fsp_margin_ok)
dump("fsp_77_laplace_channel_first_eval", "FSP", FSP,
     dict(levels=[7, 7], act_name="laplace", vector_norm="var_laplace", channel_first=True),
     (2, 2, 12), (1261, 1262, 1263), "Laplace CDF, channel-first [b, d, n], eval",
     mode="eval", margin=fsp_margin_ok)
dump("fsp_96_cauchy_inv", "FSP", FSP,
     dict(levels=[9, 6], act_name="cauchy", need_inv_act=True, quantize_rate=0.25, vector_norm="var"),
     (2, 16, 2), (1271, 1272, 1273), "Cauchy CDF with its inverse, a quarter quantized",
     margin=fsp_margin_ok)
dump("fsp_54_sigmoid_inv", "FSP", FSP,
     dict(levels=[5, 4], act_name="sigmoid", need_inv_act=True, vector_norm="var_sigmoid"),
     (2, 16, 2), (1281, 1282, 1283), "sigmoid CDF with its inverse (logit)", margin=fsp_margin_ok)

# FVQ's vq_bridge: the reference takes any module over the codes [h, c, d]
# and ships none, so a case names a torch.nn.Sequential by its layers
# ({"sequential": [["Linear", in, out], ["SiLU"], ...]}, what `quanta
# parity` builds); the same module goes to every layer, as the reference
# passes vq_kwargs on. QINCo (implicit_neural_codebook): layer i > 0
# quantizes with MLP(code, running quantized sum), a codebook per token.
def bridge(spec):
    layers = []
    for kind, *args in spec["sequential"]:
        layers.append(getattr(torch.nn, kind)(*args))
    return torch.nn.Sequential(*layers)

def with_bridge(cls):
    def ctor(**o):
        o = dict(o)
        if o.get("vq_bridge") is not None:
            o["vq_bridge"] = bridge(o["vq_bridge"])
        return cls(**o)
    return ctor

@torch.no_grad()
def transformed_codes(m, x):
    """(per-layer codes [b, n, c, d] in float64, projected input) through the
    bridge and the implicit codebook's MLPs, following the nearest code."""
    m64 = copy.deepcopy(m).double()
    layers = list(m64.layers) if isinstance(m64, ResidualVQ) else [m64]
    mlps = [None, *m64.mlps] if getattr(m64, "implicit_neural_codebook", False) else [None] * len(layers)
    r = x.detach().double()
    if getattr(m64, "has_projections", False):
        r = m64.project_in(r)
    cond = torch.zeros_like(r)
    for layer, mlp in zip(layers, mlps):
        e = layer._codebook.embed
        if layer._codebook.vq_bridge is not None:
            e = layer._codebook.vq_bridge(e)
        codes = mlp(e[0], condition=cond) if mlp is not None else e[0].expand(*r.shape[:-1], *e.shape[1:])
        d = ((r[..., None, :] - codes) ** 2).sum(-1)
        yield r, codes, d
        q = codes.gather(-2, d.argmin(-1)[..., None, None].expand(*codes.shape[:-2], 1, codes.shape[-1]))[..., 0, :]
        r, cond = r - q, cond + q

def transformed_margin_ok(m, x, mask, rel=5e-5):
    """margin_ok for transformed codebooks (vq_bridge, implicit neural codebook)."""
    for r, codes, d in transformed_codes(m, x):
        s = d.sort(-1).values
        scale = r.pow(2).sum(-1) + codes.pow(2).sum(-1).max(-1).values
        ok = (s[..., 1] - s[..., 0]) >= rel * scale
        if mask is not None:
            ok = ok[mask]
        if not ok.all():
            return False
    return True

BRIDGE = {"sequential": [["Linear", 16, 32], ["SiLU"], ["Linear", 32, 16]]}
dump("vq_bridge_mlp", "VectorQuantize", with_bridge(VectorQuantize),
     dict(dim=16, codebook_size=32, vq_bridge=BRIDGE, commitment_weight=1.0,
          threshold_ema_dead_code=0, **BASE),
     (2, 12, 16), (1291, 1292, 1293),
     "vq_bridge = Sequential(Linear(16, 32), SiLU(), Linear(32, 16)): learnable codes, no EMA; "
     "the bridge's and the codes' gradients", margin=transformed_margin_ok)
dump("rvq_q3_qinco", "ResidualVQ", ResidualVQ,
     dict(dim=16, num_quantizers=3, codebook_size=32, implicit_neural_codebook=True,
          mlp_kwargs=dict(depth=2, dim_hidden=24), commitment_weight=1.0,
          threshold_ema_dead_code=0, **BASE),
     (2, 12, 16), (1301, 1302, 1303),
     "implicit_neural_codebook: layers 1 and 2 quantize with MLP(code, running sum), "
     "depth 2, hidden 24; the MLPs' gradients", margin=transformed_margin_ok)
dump("rvq_q3_qinco_proj_masked", "ResidualVQ", ResidualVQ,
     dict(dim=16, codebook_dim=8, num_quantizers=3, codebook_size=32,
          implicit_neural_codebook=True, mlp_kwargs=dict(depth=1), commitment_weight=1.0,
          threshold_ema_dead_code=0, **BASE),
     (2, 12, 16), (1311, 1312, 1313),
     "implicit_neural_codebook with projections 16 -> 8 and a mask", mask_rows=MASK,
     margin=transformed_margin_ok)
dump("rvq_q3_qinco_eval", "ResidualVQ", ResidualVQ,
     dict(dim=16, num_quantizers=3, codebook_size=32, implicit_neural_codebook=True,
          commitment_weight=1.0, threshold_ema_dead_code=0, **BASE),
     (2, 12, 16), (1321, 1322, 1323),
     "implicit_neural_codebook in eval, the default MLP (depth 4). No parameter gradients: "
     "the reference's eval output keeps the codes' gradient, quanta's eval output has none",
     mode="eval", margin=transformed_margin_ok, param_grads=False)
dump("rvq_q2_qinco_bridge", "ResidualVQ", with_bridge(ResidualVQ),
     dict(dim=16, num_quantizers=2, codebook_size=32, implicit_neural_codebook=True,
          mlp_kwargs=dict(depth=1),
          vq_bridge={"sequential": [["Linear", 16, 16], ["Tanh"]]}, commitment_weight=1.0,
          threshold_ema_dead_code=0, **BASE),
     (2, 12, 16), (1331, 1332, 1333),
     "implicit_neural_codebook after a vq_bridge that every layer shares (bridge, then MLP)",
     margin=transformed_margin_ok)

def dump_lookup(name, cls, opts, shape, seeds, note, dropped=()):
    """get_codes_from_indices / get_output_from_indices; `dropped` lists
    (b, n, from_layer): that token's layers from from_layer on are -1."""
    if ONLY and name not in ONLY:
        return
    torch.manual_seed(seeds[0])
    mod = cls(**opts).eval()
    tensors = {k: stored(v) for k, v in mod.state_dict().items()}
    indices = torch.randint(0, opts["codebook_size"], shape,
                            generator=torch.Generator().manual_seed(seeds[1]))
    for b, n, q in dropped:
        indices[b, n, q:] = -1
    with torch.no_grad():
        codes = mod.get_codes_from_indices(indices)
        output = mod.get_output_from_indices(indices)
    tensors.update(indices=indices, codes=codes, output=output)
    spec = {"case": name, "kind": "lookup", "class": cls.__name__,
            "module": "vector_quantize_pytorch." + cls.__name__, "constructor_options": opts,
            "mode": "eval", "calls": ["codes = module.get_codes_from_indices(indices)",
                                      "output = module.get_output_from_indices(indices)"],
            "randomness": {"module_init": f"torch.manual_seed({seeds[0]}) then construct",
                           "indices": f"torch.randint with torch.Generator().manual_seed({seeds[1]}), "
                                      f"then -1 from layer q on at (b, n, q) in {list(dropped)}"},
            "state_aliases": {}, "note": note,
            "peer": {"vector_quantize_pytorch": "1.32.0", "torch": torch.__version__,
                     "python": platform.python_version(), "device": "cpu", "dtype": "float32",
                     "threads": 1}}
    metadata = {"case": name, "kind": "lookup", "class": cls.__name__, "mode": "eval",
                "library_version": "vector-quantize-pytorch 1.32.0",
                "torch_version": torch.__version__, "format": "safetensors; reference vectors v1",
                "spec": json.dumps(spec)}
    save_file({k: v.detach().contiguous().clone() for k, v in tensors.items()},
              f"{out}/{name}.safetensors", metadata=metadata)
    print(name, {k: tuple(v.shape) for k, v in tensors.items()})

# HierarchicalVQ: its indices (a tuple of [b, level shape...]) flattened per
# level and concatenated, [b, sum of level sizes], quanta's layout; nested
# dropout's cutoff recorded as draws.cutoff (-1: every level kept). The margin
# check runs a float64 copy in the same mode and checks every level's tokens
# against the codebook that level quantizes with (a shared codebook moves
# between levels in training).
class FlatHierarchicalVQ(HierarchicalVQ):
    def forward(self, x, **kwargs):
        rec, indices, loss, cutoff = super().forward(x, return_cutoff=True, **kwargs)
        self.recorded_draws = {"draws.cutoff": torch.tensor(-1 if cutoff is None else cutoff)}
        return rec, torch.cat([i.flatten(1) for i in indices], dim=1), loss

def hvq_margin_ok(m, x, mask, rel=5e-5):
    m64 = copy.deepcopy(m).double()
    ok = [True]
    def check(vq, args, kwargs):
        r = args[0].detach().reshape(-1, args[0].shape[-1])
        if kwargs.get("mask") is not None:
            r = r[kwargs["mask"].reshape(-1)]
        e = vq._codebook.embed[0].detach()
        d = r.pow(2).sum(-1, keepdim=True) + e.pow(2).sum(-1) - 2 * r @ e.T
        s = d.sort(-1).values
        scale = r.pow(2).sum(-1) + e.pow(2).sum(-1).max()
        ok[0] &= bool(((s[:, 1] - s[:, 0]) >= rel * scale).all())
    for vq in ([m64.vq] if m64.vq is not None else list(m64.vqs)):
        vq.register_forward_pre_hook(check, with_kwargs=True)
    with torch.no_grad() if not m.training else torch.enable_grad():
        m64(x.double(), **({"mask": mask} if mask is not None else {}))
    return ok[0]

HVQ = dict(decay=0.8, kmeans_init=False, threshold_ema_dead_code=0)
MASK_1D = [[True] * 8 + [False] * 2, [True] * 5 + [False] * 5]
MASK_2D = [[[True] * 6] * 4 + [[False] * 6] * 2, [[True] * 3 + [False] * 3] * 6]
dump("hvq_1d_shared", "HierarchicalVQ", FlatHierarchicalVQ,
     dict(dim=8, codebook_size=16, scales=[1, 3, 5, 10], **HVQ), (2, 8, 10), (1351, 1352, 1353),
     "1-d [b, c, n], a shared codebook (its EMA moves between levels), one Phi (quant_resi 0.5)",
     margin=hvq_margin_ok)
dump("hvq_1d_levels_masked_resi2", "HierarchicalVQ", FlatHierarchicalVQ,
     dict(dim=8, codebook_size=[16, 16, 24, 32], scales=[1, 3, 5, 10], shared_codebook=False,
          share_quant_resi=2, **HVQ), (2, 8, 10), (1361, 1362, 1363),
     "a codebook per level, two Phi convolutions chosen by level depth, a mask "
     "(masked pooling, the coarsest level a masked mean)", mask_rows=MASK_1D, margin=hvq_margin_ok)
dump("hvq_2d_shared", "HierarchicalVQ", FlatHierarchicalVQ,
     dict(dim=8, codebook_size=16, scales=[1, [2, 3], 4, 6], accept_image_fmap=True, **HVQ),
     (2, 8, 6, 6), (1371, 1372, 1373),
     "2-d feature maps, per-dim scales, bilinear upsampling, a shared codebook",
     margin=hvq_margin_ok)
dump("hvq_2d_levels_masked_channel_last_eval", "HierarchicalVQ", FlatHierarchicalVQ,
     dict(dim=8, codebook_size=[8, 16, 16], scales=[1, 3, 6], shared_codebook=False,
          share_quant_resi=0, channel_first=False, accept_image_fmap=True, **HVQ),
     (2, 6, 6, 8), (1381, 1382, 1383),
     "2-d channel-last [b, h, w, c], a codebook and a Phi per level, a mask, eval",
     mask_rows=MASK_2D, mode="eval", margin=hvq_margin_ok)
dump("hvq_3d_shared_resi3", "HierarchicalVQ", FlatHierarchicalVQ,
     dict(dim=8, codebook_size=16, scales=[1, [1, 2, 2], [2, 3, 4]], accept_3d_fmap=True,
          share_quant_resi=3, **HVQ),
     (2, 8, 2, 3, 4), (1401, 1402, 1403),
     "3-d volumes [b, c, d, h, w], trilinear upsampling, a Conv3d Phi per level",
     margin=hvq_margin_ok)
dump("hvq_1d_nested_dropout", "HierarchicalVQ", FlatHierarchicalVQ,
     dict(dim=8, codebook_size=16, scales=[1, 2, 4, 8], nested_dropout=1.0, **HVQ),
     (2, 8, 8), (1391, 1392, 1393),
     "nested_dropout=1: only levels 0..cutoff reconstruct and count in the loss; "
     "draws.cutoff holds the reference's cutoff", margin=hvq_margin_ok)

dump_lookup("lookup_rvq_q3_qinco_proj", ResidualVQ,
            dict(dim=16, codebook_dim=8, num_quantizers=3, codebook_size=32,
                 implicit_neural_codebook=True, mlp_kwargs=dict(depth=2), quantize_dropout=True),
            (2, 10, 3), (1341, 1342),
            "codes derived layer by layer through the MLPs; dropped layers (-1) at the end give zeros",
            dropped=((0, 3, 2), (1, 7, 1)))
