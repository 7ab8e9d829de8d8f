"""What transformers computes for packed sequences: several documents in one
row, told apart by position_ids that restart at 0 (transformers'
find_packed_sequence_indices: a new document starts wherever a position is
not the previous one plus 1), each token attending only within its document,
and the first label of every document left out (-100), as
DataCollatorWithFlattening makes them. Run with the peer environment:

    /tmp/peer-venv/bin/python tests/data/llm/make_packed_fixtures.py tests/data/llm

expected/packed_<name>.safetensors, for the tiny folders under models/:
  input_ids [2, 12] (I64), position_ids [2, 12] (I64), labels [2, 12] (I64),
  logits [2, 12, vocab] (F32), loss [] (F32)
"""
import os
import sys

import torch
import transformers
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

# Documents per row: lengths add up to the row's 12 tokens.
ROWS = [[5, 4, 3], [7, 5]]


def main(root):
    for i, name in enumerate(["llama_gqa", "qwen2_bias"]):
        model = AutoModelForCausalLM.from_pretrained(os.path.join(root, "models", name)).eval()
        vocab = model.config.vocab_size
        ids = torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(90 + i))
        positions = torch.tensor([[p for n in row for p in range(n)] for row in ROWS])
        labels = ids.clone()
        labels[positions == 0] = -100
        with torch.no_grad():
            # use_cache=False: a cache turns the packed-sequence detection off,
            # as in training.
            out = model(input_ids=ids, position_ids=positions, labels=labels, use_cache=False)
        save_file({
            "input_ids": ids.contiguous(),
            "position_ids": positions.contiguous(),
            "labels": labels.contiguous(),
            "logits": out.logits.float().contiguous(),
            "loss": out.loss.float().reshape(()).contiguous(),
        }, os.path.join(root, "expected", "packed_" + name + ".safetensors"),
            metadata={"transformers": transformers.__version__, "torch": torch.__version__})
        print(name, float(out.loss))


if __name__ == "__main__":
    main(sys.argv[1])
