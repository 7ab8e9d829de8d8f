"""PyTorch's side of `quanta bench llm`: the same workloads timed in a
long-lived process that quanta drives over stdin/stdout, so that the two
sides alternate round by round on the same machine.

Protocol (one line each way): quanta writes `setup NAME KEY=VALUE...`
(answer `ok`), then `time NAME CALLS` (answer: milliseconds per call, the
mean of CALLS calls); `peak NAME KEY=VALUE...` answers the peak resident
memory in MB of a fresh python process (this script with --peak) that
imports the same libraries, sets NAME up and runs it twice, as quanta
measures its own side in a fresh process. `quit` ends it.

Workloads, matching tools/quanta/bench/llm.cpp:
  attention   B H T D causal: F.scaled_dot_product_attention forward
  attention_fb               forward + backward
  llama_fwd   a ~100M-parameter LlamaForCausalLM (random weights), B x T ids
  llama_fb    forward + backward of its causal-LM loss (autocast=1: the
              forward under torch.autocast("cpu", dtype=torch.bfloat16);
              bf16=1: the model in bf16)
  qlora       one QLoRA step of that model: bitsandbytes load_in_4bit (NF4,
              double quant, bf16 compute when bf16=1, else f32), PEFT LoRA r
              on all linear layers (alpha 2r, dropout 0.05), forward +
              backward + AdamW (autocast=1: the forward under autocast;
              checkpointing=1: each decoder layer recomputed in the backward;
              dora=1: PEFT's DoRA, use_dora=True)

KEY=VALUE words are integers; cuda=1 runs the workload on the GPU (quanta's
--device cuda), with torch.cuda.synchronize() ending each timed batch.

Run by quanta with the peer environment's python (../shared/peer/setup.sh):
/tmp/peer-venv/bin/python tools/peer/llm_bench_peer.py
"""
import gc
import os
import subprocess
import sys
import time

# The two sides take turns on the same cores: OpenMP threads that spin
# after their work would steal the other side's time, so they sleep.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402 (after the OpenMP setting)
import torch.nn.functional as F  # noqa: E402


def device(cfg):
    """Where a workload runs: cuda=1 puts it on the GPU (quanta's --device cuda)."""
    return "cuda" if cfg.get("cuda") else "cpu"


def llama(cfg):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=cfg["vocab"], hidden_size=cfg["hidden"], intermediate_size=cfg["ffn"],
        num_hidden_layers=cfg["layers"], num_attention_heads=cfg["heads"],
        num_key_value_heads=cfg["kv_heads"], max_position_embeddings=4096,
        rms_norm_eps=1e-5, tie_word_embeddings=True, attn_implementation="sdpa")
    torch.manual_seed(0)
    return LlamaForCausalLM(config).float()


def parse_config(words):
    return {k: int(v) for k, v in (p.split("=") for p in words)}


def own_peak_rss_mb():
    """This process's peak resident memory since its exec (VmHWM).

    Not getrusage's ru_maxrss: Linux carries the maximum across exec, so a
    child started from this server would report the server's own memory
    when that was larger (measured: a child of a 400 MB parent read 413 MB
    there, 13.6 MB in VmHWM)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    raise RuntimeError("/proc/self/status has no VmHWM")


def peak_child(name, words):
    """In a fresh process: set NAME up, run it twice, print the peak RSS."""
    fn = make(name, parse_config(words))
    fn()
    fn()
    print(own_peak_rss_mb(), flush=True)


def peak(threads, name, words):
    done = subprocess.run(
        [sys.executable, __file__, str(threads), "--peak", name, *words],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    lines = done.stdout.split()
    if done.returncode != 0 or not lines:
        return "failed (exit status %d)" % done.returncode
    return lines[-1]


def main():
    threads = int(sys.argv[1]) if len(sys.argv) > 1 else torch.get_num_threads()
    torch.set_num_threads(threads)
    if len(sys.argv) > 3 and sys.argv[2] == "--peak":
        peak_child(sys.argv[3], sys.argv[4:])
        return
    work = {}
    for line in sys.stdin:
        parts = line.split()
        if not parts:
            continue
        if parts[0] == "quit":
            break
        if parts[0] == "setup":
            name = parts[1]
            try:
                work[name] = make(name, parse_config(parts[2:]))
            except Exception as e:  # one line back: quanta's row says why
                print("failed: %s: %s" % (type(e).__name__, str(e).splitlines()[0] if str(e)
                                          else ""), flush=True)
                continue
            print("ok", flush=True)
        elif parts[0] == "peak":
            # The fresh process measures alone: what this one holds goes
            # first, so the machine holds one model at a time.
            work.clear()
            gc.collect()
            print(peak(threads, parts[1], parts[2:]), flush=True)
        elif parts[0] == "time":
            fn = work[parts[1]]
            calls = int(parts[2])
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            # A GPU's calls count when their work is done, as quanta's do.
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.synchronize()
            print((time.perf_counter() - start) * 1000 / calls, flush=True)


def qlora(cfg):
    import tempfile

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    with tempfile.TemporaryDirectory() as folder:
        llama(cfg).save_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(
            folder, dtype=torch.float32, device_map={"": 0} if cfg.get("cuda") else "cpu",
            quantization_config=BitsAndBytesConfig(
                load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                bnb_4bit_compute_dtype=torch.bfloat16 if cfg.get("bf16") else torch.float32))
    if cfg.get("checkpointing"):
        # Each decoder layer recomputed in the backward, as
        # prepare_model_for_kbit_training sets it up.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = get_peft_model(model, LoraConfig(r=cfg["r"], lora_alpha=2 * cfg["r"],
                                             lora_dropout=0.05, target_modules="all-linear",
                                             use_dora=bool(cfg.get("dora")), task_type="CAUSAL_LM"))
    model.train()
    return model


def make(name, cfg):
    g = torch.Generator().manual_seed(1)
    if name.startswith("attention"):
        B, H, T, D = cfg["B"], cfg["H"], cfg["T"], cfg["D"]
        q, k, v = (torch.randn(B, H, T, D, generator=g).to(device(cfg)).requires_grad_(True)
                   for _ in range(3))
        grad = torch.randn(B, H, T, D, generator=g).to(device(cfg))
        if name.endswith("_fb"):
            def fb():
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                o.backward(grad)
            return fb
        def fwd():
            with torch.no_grad():
                F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return fwd
    if name == "qlora":
        model = qlora(cfg)
        ids = torch.randint(0, cfg["vocab"], (cfg["B"], cfg["T"]), generator=g).to(device(cfg))
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-4,
                                weight_decay=0.0)

        def step():
            opt.zero_grad(set_to_none=True)
            with torch.autocast(device(cfg), dtype=torch.bfloat16,
                                enabled=bool(cfg.get("autocast"))):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
        return step
    model = llama(cfg).to(device(cfg))
    if cfg.get("bf16"):  # the model itself in bf16 (its torch_dtype)
        model = model.to(torch.bfloat16)
    ids = torch.randint(0, cfg["vocab"], (cfg["B"], cfg["T"]), generator=g).to(device(cfg))
    if name.endswith("_fb"):
        model.train()
        def fb():
            model.zero_grad(set_to_none=True)
            with torch.autocast(device(cfg), dtype=torch.bfloat16,
                                enabled=bool(cfg.get("autocast"))):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
        return fb
    model.eval()
    def fwd():
        with torch.no_grad():
            model(input_ids=ids)
    return fwd


if __name__ == "__main__":
    main()
