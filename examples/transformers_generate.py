# SPDX-License-Identifier: Apache-2.0
"""Generate with transformers' MiniMax-M3 whose sparse layers run on openmsa.

    python examples/transformers_generate.py                  # a tiny random model, on the CPU
    python examples/transformers_generate.py --model /path/to/MiniMax-M3 --prompt "Hello" \\
        --device cuda --kv-cache-dtype bf16 --index-cache-dtype fp8

Without --model it builds a small random `MiniMaxM3VLForCausalLM` (blocks of 4 tokens, top-4, so
a 100-token prompt already selects), generates greedily with transformers' own attention and with
openmsa, and prints both (they agree: same weights, same selection rule).
"""

import argparse
import copy

import torch


def tiny_model():
    from transformers import MiniMaxM3VLForCausalLM, MiniMaxM3VLTextConfig

    cfg = MiniMaxM3VLTextConfig(
        vocab_size=256, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, rotary_dim=8, partial_rotary_factor=0.5,
        index_n_heads=2, index_head_dim=16, index_block_size=4, index_topk_blocks=4,
        layer_types=["full_attention", "minimax_m3_sparse", "minimax_m3_sparse"],
        mlp_layer_types=["dense"] * 3, dense_intermediate_size=128, bos_token_id=1,
        eos_token_id=2, pad_token_id=0)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = MiniMaxM3VLForCausalLM(cfg).eval()
    with torch.no_grad():  # random Gemma norm weights (transformers starts them at zero)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0, 0.2)
    return model


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="a local MiniMax-M3 checkpoint directory (default: tiny)")
    p.add_argument("--prompt", default="The capital of France is")
    p.add_argument("--device", default="cpu")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--kv-cache-dtype", default=None)
    p.add_argument("--index-cache-dtype", default=None)
    p.add_argument("--prefill-chunk-size", type=int, default=8192)
    args = p.parse_args()

    import transformers
    from openmsa.integrations.transformers import use_openmsa

    transformers.logging.set_verbosity_error()
    if args.model is None:
        model = tiny_model().to(args.device)
        ids = torch.randint(3, 256, (1, 100), generator=torch.Generator().manual_seed(1))
        ids = ids.to(args.device)
        theirs = model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False)
        model = use_openmsa(copy.deepcopy(model), kv_cache_dtype=args.kv_cache_dtype,
                            index_cache_dtype=args.index_cache_dtype,
                            prefill_chunk_size=args.prefill_chunk_size)
        ours = model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False)
        print("transformers:", theirs[0, ids.shape[1]:].tolist())
        print("openmsa:     ", ours[0, ids.shape[1]:].tolist())
        return
    tok = transformers.AutoTokenizer.from_pretrained(args.model)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        args.model, dtype=torch.bfloat16, device_map=args.device)
    model = use_openmsa(model, kv_cache_dtype=args.kv_cache_dtype,
                        index_cache_dtype=args.index_cache_dtype,
                        prefill_chunk_size=args.prefill_chunk_size)
    inputs = tok(args.prompt, return_tensors="pt").to(args.device)
    out = model.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False)
    print(tok.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))


if __name__ == "__main__":
    main()
