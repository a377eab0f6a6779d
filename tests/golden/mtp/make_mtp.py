#!/usr/bin/env python3
"""Makes the MTP test checkpoints and their goldens (tests/models/mtp/).

  /path/to/venv/bin/python tests/golden/mtp/make_mtp.py [OUTDIR [NAME...]]
      (default tests/models/mtp, every checkpoint; names pick some)

Needs torch and transformers 5.25 (its generic MtpModel, what
generate(use_mtp=True) runs); CI never runs this, the tests read what it wrote.

Each checkpoint is a tiny random model with num_nextn_predict_layers 1 on the
384-token byte-level vocabulary of tests/models/quant (tokenizer.json linked):

  dsv3     deepseek_v3: MLA (q_lora 32, interleaved RoPE), 2 layers (the first
           dense), 4 experts top-2 + a shared expert
  glm4moe  glm4_moe: GQA (4 heads, 2 KV heads, q/k/v bias, q/k norm, RoPE on
           half of each head), 2 layers (the first dense), 8 experts in 2
           groups top-2 + a shared expert

The MTP module is transformers' MtpLayer: enorm, hnorm, eh_proj, one decoder
layer of the model's kind (MoE: get_mtp_config sets first_k_dense_replace 0)
and shared_head.norm (its post_norm); embedding and head are the main model's.
It is stored as DeepSeek-V3 and GLM-4.5 checkpoints store it: model.layers.<N>.*
with N = num_hidden_layers, the decoder layer's tensors under the same names as
a decoder layer's (taken from a one-layer model of the class holding it), plus
copies of the embedding and head (embed_tokens, shared_head.head). The script
reloads the file through MtpModel.from_pretrained (the loader generate() uses)
and checks every MTP parameter came back as saved.

 glm4moe-w8main  glm4moe with its decoder layers' projections int8 in the same
           format for the config's "Linear" target, the MTP layer left bf16 and
           not in ignore (what exports of the seed's model do)
 glm4moe-w8mtp  glm4moe with its MTP layer's projections (eh_proj, attention,
           experts, shared experts; not the router) stored as compressed-tensors
           pack-quantized int8, per channel, symmetric, round to nearest (what
           llmcompressor writes); the main layers stay bf16 (a regex target in
           quantization_config names the MTP layer). Its golden comes from the
           same model with those weights dequantized (q * scale, rounded to
           bf16), run by transformers unquantized

golden.json:
  ids        a prompt (n_prompt ids) and the main model's greedy continuation
  mtp        for every position q >= 1 of ids: the MTP layer's output given the
             true tokens (entry q is made from ids[q] and the main model's
             final-normed hidden state at q - 1; it predicts ids[q + 1]), as
             the top TOPK logits (ids, values)
  drafts     at a few positions p: K = 3 greedy drafts chained from p (the
             first from ids[p + 1] and the hidden state at p; each next one from
             the draft before it and the MTP layer's own output at its
             position, post_norm applied, as MtpModel feeds one layer to the
             next), with each draft's top TOPK logits

Ties: every argmax above (main greedy, MTP drafts) keeps a margin over the
runner-up, and every MoE routing choice in the MTP layer a margin over the best
unchosen expert, of at least 1e-3 (relative to the largest score), else the next
seed is tried: bf16 vs f32 rounding must not flip a golden.
"""
import copy, json, os, re, shutil, sys, tempfile
import torch
import transformers
from transformers import AutoModelForCausalLM
from transformers.modeling_layers import MtpModel
from safetensors.torch import load_file, save_file

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", "..", ".."))
TOKDIR = os.path.join(ROOT, "tests", "models", "quant", "ct-w4g32-sym")
TOPK, K, N_GREEDY, MARGIN = 8, 3, 28, 1e-3
PROMPT = [200, 33, 7, 8, 300, 12, 64, 77, 101, 250, 3, 19, 44, 45, 46, 120, 121, 380, 2, 9, 66]

COMMON = dict(vocab_size=384, hidden_size=64, intermediate_size=96, num_attention_heads=4,
              max_position_embeddings=512, rms_norm_eps=1e-5, bos_token_id=None, eos_token_id=0,
              tie_word_embeddings=False, num_hidden_layers=2, first_k_dense_replace=1, num_nextn_predict_layers=1,
              n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True)


def configs():
    return {
        "dsv3": transformers.DeepseekV3Config(
            **COMMON, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=32, qk_nope_head_dim=16,
            qk_rope_head_dim=8, v_head_dim=12, rope_interleave=True, n_routed_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=32, n_group=1, topk_group=1,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        "glm4moe": transformers.Glm4MoeConfig(
            **COMMON, num_key_value_heads=2, head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
            moe_intermediate_size=16, n_group=2, topk_group=1, attention_bias=True, use_qk_norm=True,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
    }


def randomize(module, gen=None):
    """Every parameter and the routers' correction biases random (norms around 1)."""
    def rnd(t):
        return torch.randn(t.shape, generator=gen, dtype=t.dtype)
    with torch.no_grad():
        for n, p in module.named_parameters():
            if p.dim() == 1:
                p.copy_((1.0 if "norm" in n else 0.0) + 0.2 * rnd(p))
            else:
                p.copy_(0.15 * rnd(p))
        for n, b in module.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.copy_(0.05 * rnd(b))


def mtp_checkpoint_tensors(main, cfg, gen=None):
    """A random MTP module for main (MtpModel(main, 1)) and its tensors as a
    checkpoint stores them after the last decoder layer. The global RNG is
    left as it was (gen draws the values)."""
    N = cfg.num_hidden_layers
    with torch.random.fork_rng():
        mtp = MtpModel(main, 1)
        randomize(mtp.layers, gen)
        one_cfg = copy.deepcopy(cfg)
        one_cfg.num_hidden_layers, one_cfg.first_k_dense_replace, one_cfg.num_nextn_predict_layers = 1, 0, 0
        one = AutoModelForCausalLM.from_config(one_cfg, dtype=torch.float32)
    one.model.layers[0].load_state_dict(mtp.layers[0].mtp_block.state_dict())
    for n, b in mtp.layers[0].mtp_block.named_buffers():
        dict(one.model.layers[0].named_buffers())[n].copy_(b)
    with tempfile.TemporaryDirectory() as tmp:
        one.to(torch.bfloat16).save_pretrained(tmp, safe_serialization=True)
        sd = load_file(os.path.join(tmp, "model.safetensors"))
    p = f"model.layers.{N}."
    t = {p + k[len("model.layers.0."):]: v for k, v in sd.items() if k.startswith("model.layers.0.")}
    L = mtp.layers[0]
    t.update({p + "enorm.weight": L.enorm.weight, p + "hnorm.weight": L.hnorm.weight,
              p + "eh_proj.weight": L.eh_proj.weight, p + "shared_head.norm.weight": L.post_norm.weight,
              p + "shared_head.head.weight": main.lm_head.weight, p + "embed_tokens.weight":
              main.model.embed_tokens.weight})
    return mtp, {k: v.detach().to(torch.bfloat16).contiguous() for k, v in t.items()}


def int8_channel(w):
    """w [out][in] as pack-quantized int8 per output channel, symmetric, round
    to nearest: (weight_packed int32 [out][in/4] holding q + 128 low bits
    first, weight_scale bf16 [out][1], the bf16 values they stand for)."""
    w = w.float()
    scale = (w.abs().amax(1, keepdim=True) / 127.5).to(torch.bfloat16).float()
    q = torch.clamp(torch.round((w / scale).to(torch.bfloat16).float()), -128, 127).to(torch.int64)
    u = (q + 128).view(w.shape[0], -1, 4)
    words = (u[..., 0] | u[..., 1] << 8 | u[..., 2] << 16 | u[..., 3] << 24)
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)
    return words, scale.to(torch.bfloat16), (q.float() * scale).to(torch.bfloat16)


def w8_tensors(sd, target):
    """The 2-D weights of sd whose module matches the regex target quantized
    (int8_channel): (the tensors to store, the dense tensors they stand for)."""
    stored, dense = {}, {}
    for k, v in sd.items():
        mod = k[: -len(".weight")]
        if k.endswith(".weight") and re.match(target, mod) and v.dim() == 2:
            packed, scale, deq = int8_channel(v)
            stored.update({mod + ".weight_packed": packed, mod + ".weight_scale": scale,
                           mod + ".weight_shape": torch.tensor(list(v.shape), dtype=torch.int64)})
            dense[k] = deq
        else:
            stored[k] = v
            dense[k] = v
    return stored, dense


def w8_config(targets, ignore):
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "ignore": ignore, "config_groups": {"group_0": {
                "targets": targets, "format": "pack-quantized", "input_activations": None, "output_activations": None,
                "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel",
                            "group_size": None, "dynamic": False}}}}


def w8_variant(m, cfg, extra, outdir, name, target, targets, ignore):
    """A copy of the checkpoint with the weights matching target int8
    (quantization_config: targets, ignore), and its golden from the dense
    weights those stand for."""
    with tempfile.TemporaryDirectory() as tmp:
        save(m, os.path.join(tmp, "src"), extra)
        sd = load_file(os.path.join(tmp, "src", "model.safetensors"))
        stored, dense = w8_tensors(sd, target)
        save_file(dense, os.path.join(tmp, "src", "model.safetensors"), metadata={"format": "pt"})
        main3, mtp3 = load_pair(os.path.join(tmp, "src"), cfg.num_hidden_layers)
        g, why = golden(main3, mtp3, name + " (dequantized)")
    print(name, why, flush=True)
    if not g:
        sys.exit(name + ": near-ties with the dequantized weights")
    qpath = os.path.join(outdir, name)
    save(m, qpath, {})
    save_file(stored, os.path.join(qpath, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(qpath, "config.json")) as fh:
        c = json.load(fh)
    c["quantization_config"] = w8_config(targets, ignore)
    with open(os.path.join(qpath, "config.json"), "w") as fh:
        json.dump(c, fh, indent=2)
    with open(os.path.join(qpath, "golden.json"), "w") as fh:
        json.dump(g, fh)
    print(name, "drafts", [d["drafts"] for d in g["drafts"]], flush=True)


def save(m, path, extra):
    shutil.rmtree(path, ignore_errors=True)
    m.to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
    f = os.path.join(path, "model.safetensors")
    sd = load_file(f)
    sd.update(extra)
    save_file(sd, f, metadata={"format": "pt"})
    os.symlink("../../quant/ct-w4g32-sym/tokenizer.json", os.path.join(path, "tokenizer.json"))
    shutil.copy(os.path.join(TOKDIR, "tokenizer_config.json"), path)


def load_pair(path, N):
    main = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    # the main class names the MTP layer of the full-size checkpoint (e.g. layers.61): point it at this one's
    main._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{N}\..*"]
    mtp = MtpModel.from_pretrained(main, device_map={"": "cpu"}).float().eval()
    return main, mtp


def margin(v):
    s = torch.sort(v.float(), descending=True).values
    return float(s[0] - s[1]) / max(float(s.abs().max()), 1e-9)


@torch.no_grad()
def golden(main, mtp, name):
    seq = list(PROMPT)
    for _ in range(N_GREEDY):  # full forwards, no cache: the reference for every position
        lg = main(torch.tensor([seq])).logits[0, -1]
        worst = margin(lg)
        if worst < MARGIN:
            return None, f"main greedy near-tie {worst:.2e}"
        seq.append(int(lg.argmax()))
    L = len(seq)
    out = main.model(torch.tensor([seq]))
    h = out.last_hidden_state[0]  # after the final norm
    hs = main(torch.tensor([seq]), output_hidden_states=True).hidden_states[-1][0]
    assert torch.equal(h, hs), "hidden_states[-1] (what MTPCandidateGenerator feeds) is not the final-normed state"

    routes = []
    gate = mtp.layers[0].mtp_block.mlp.gate
    hook = gate.register_forward_hook(lambda mod, inp, o: routes.append(inp[0].reshape(-1, inp[0].shape[-1])))

    def run(ids, hid):
        pos = torch.arange(1, len(ids) + 1)[None]
        g = mtp.forward_layer(0, hid[None], pos, None, input_ids=torch.tensor([ids]))
        return g[0], mtp._project_to_logits(g)[0]

    _, lg = run(seq[1:], h[: L - 1])
    g = {"model": name, "transformers": transformers.__version__, "ids": seq, "n_prompt": len(PROMPT),
         "mtp": [], "drafts": []}
    for q in range(1, L):
        top = torch.topk(lg[q - 1], TOPK)
        g["mtp"].append({"pos": q, "top_ids": top.indices.tolist(), "top_logits": [float(v) for v in top.values]})
    for p in [len(PROMPT) - 1, len(PROMPT) + 2, len(PROMPT) + 9, L - K - 2]:
        ids, hid, d = seq[1: p + 2], h[: p + 1], {"pos": p, "token": seq[p + 1], "drafts": [], "top_ids": [],
                                                  "top_logits": []}
        for _ in range(K):
            gg, lg2 = run(ids, hid)
            last = lg2[-1]
            if margin(last) < MARGIN:
                return None, f"draft near-tie {margin(last):.2e} at {p}"
            top = torch.topk(last, TOPK)
            d["drafts"].append(int(last.argmax()))
            d["top_ids"].append(top.indices.tolist())
            d["top_logits"].append([float(v) for v in top.values])
            ids = ids + [d["drafts"][-1]]
            hid = torch.cat([hid, gg[-1:]], 0)
        g["drafts"].append(d)
    hook.remove()
    # routing margins of every MTP token seen
    x = torch.cat(routes, 0).float()
    s = (x @ gate.weight.float().t()).sigmoid() + gate.e_score_correction_bias
    worst = 1.0
    for row in s:
        grp = row.view(gate.num_group, -1)
        gs = grp.topk(min(2, grp.shape[1]), dim=-1)[0].sum(-1)
        keep = gs.topk(gate.topk_group).indices
        cand = torch.cat([grp[i] for i in sorted(keep.tolist())])
        v = torch.sort(cand, descending=True).values
        worst = min(worst, float(v[gate.top_k - 1] - v[gate.top_k]) / float(v.abs().max()))
        if gate.num_group > 1:
            gsv = torch.sort(gs, descending=True).values
            worst = min(worst, float(gsv[gate.topk_group - 1] - gsv[gate.topk_group]) / float(gsv.abs().max()))
    if worst < MARGIN:
        return None, f"MTP routing near-tie {worst:.2e}"
    # transformers' own speculative loop with this MTP layer gives plain greedy's tokens
    x = torch.tensor([PROMPT])
    plain = main.generate(x, max_new_tokens=8, do_sample=False, pad_token_id=0)
    spec = main.generate(x, max_new_tokens=8, do_sample=False, use_mtp=True, pad_token_id=0)
    assert torch.equal(plain, spec), "generate(use_mtp=True) differs from plain greedy"
    return g, f"margins ok (routing {worst:.2e})"


def main():
    outdir = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "tests", "models", "mtp")
    only = set(sys.argv[2:])
    os.makedirs(outdir, exist_ok=True)
    for name, cfg in configs().items():
        if only and name not in only:
            continue
        path = os.path.join(outdir, name)
        for seed in range(1000, 1040):
            torch.manual_seed(seed)
            m = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
            randomize(m)
            gen = torch.Generator().manual_seed(seed + 7)
            mtp0, extra = mtp_checkpoint_tensors(m, cfg, gen)
            save(m, path, extra)
            main2, mtp2 = load_pair(path, cfg.num_hidden_layers)
            want = {k: v.detach().to(torch.bfloat16).float() for k, v in mtp0.layers.state_dict().items()}
            got = mtp2.layers.state_dict()
            assert want.keys() == got.keys(), set(want) ^ set(got)
            for k in want:
                assert torch.equal(want[k], got[k].float()), f"{k} did not load as saved"
            g, why = golden(main2, mtp2, name)
            print(name, "seed", seed, why, flush=True)
            if g:
                break
        else:
            sys.exit(f"{name}: no seed without near-ties")
        with open(os.path.join(path, "golden.json"), "w") as fh:
            json.dump(g, fh)
        print(name, "greedy", g["ids"][len(PROMPT):], "drafts", [d["drafts"] for d in g["drafts"]], flush=True)
        if name != "glm4moe":
            continue
        N = cfg.num_hidden_layers
        mtp_target = rf"model\.layers\.{N}\..*_proj$"
        w8_variant(m, cfg, extra, outdir, name + "-w8mtp", mtp_target, ["re:" + mtp_target], [])
        # the seed checkpoint's trap: the decoder layers quantized for "Linear" targets, the MTP layer left bf16
        # and not in ignore
        w8_variant(m, cfg, extra, outdir, name + "-w8main", rf"model\.layers\.([0-{N - 1}])\..*_proj$",
                   ["Linear"], ["lm_head"])


if __name__ == "__main__":
    main()
