"""frugal.param_groups: which tensors are projectable, on tiny transformers models (random init, no
download), and the state FRUGAL then holds against Appendix D's formula."""
import re

import pytest
import torch
import transformers as tf
from torch import nn

import frugal
from frugal.grouping import block_lists, module_roles, param_groups, transformer_blocks


def _llama(layers=3):
    return tf.LlamaForCausalLM(tf.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=4,
        num_hidden_layers=layers, vocab_size=64, max_position_embeddings=32, tie_word_embeddings=False))


def _gpt2(layers=2):
    return tf.GPT2LMHeadModel(tf.GPT2Config(n_embd=32, n_layer=layers, n_head=4, vocab_size=64, n_positions=32,
                                            bos_token_id=0, eos_token_id=0))


@pytest.fixture(scope="module")
def llama():
    torch.manual_seed(0)
    return _llama()


@pytest.fixture(scope="module")
def gpt2():
    torch.manual_seed(0)
    return _gpt2()


def _named(model, groups):
    names = {id(p): n for n, p in model.named_parameters()}
    return [({k: v for k, v in g.items() if k != "params"}, [names[id(p)] for p in g["params"]])
            for g in groups]


def _all_params_once(model, groups):
    listed = [id(p) for g in groups for p in g["params"]]
    assert len(listed) == len(set(listed)), "a parameter is listed twice"
    assert set(listed) == {id(p) for p in model.parameters()}


def test_llama_projectable_blocks(llama):
    groups = param_groups(llama)
    _all_params_once(llama, groups)
    named = _named(llama, groups)
    projectable = [(meta, names) for meta, names in named if meta.get("projectable")]
    assert [meta["block"] for meta, _ in projectable] == [0, 1, 2]
    for meta, names in projectable:
        assert meta["transposed"] is False
        n = meta["block"]
        expected = [f"model.layers.{n}.self_attn.{x}_proj.weight" for x in "qkvo"]
        expected += [f"model.layers.{n}.mlp.{x}_proj.weight" for x in ("gate", "up", "down")]
        assert sorted(names) == sorted(expected)
    (rest_meta, rest), = [(m, n) for m, n in named if not m.get("projectable")]
    assert not rest_meta.get("always_state_free", False)
    assert "model.embed_tokens.weight" in rest and "lm_head.weight" in rest
    assert "model.norm.weight" in rest and "model.layers.0.input_layernorm.weight" in rest
    assert len(rest) == 2 + 2 * 3 + 1


def test_gpt2_conv1d_transposed_and_tied_once(gpt2):
    groups = param_groups(gpt2)
    _all_params_once(gpt2, groups)
    named = _named(gpt2, groups)
    projectable = [(meta, names) for meta, names in named if meta.get("projectable")]
    assert [meta["block"] for meta, _ in projectable] == [0, 1]
    for meta, names in projectable:
        assert meta["transposed"] is True
        n = meta["block"]
        assert sorted(names) == sorted(
            f"transformer.h.{n}.{m}.weight" for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"))
    rest = [n for meta, names in named if not meta.get("projectable") for n in names]
    assert "transformer.wte.weight" in rest  # tied with lm_head: listed once
    assert all(n.endswith(".bias") or "ln_" in n or n.startswith("transformer.w") for n in rest)


def _kinds(model, names):
    roles = {r.name: r.kinds for r in module_roles(model)}
    return set().union(*(roles[n] for n in names))


@pytest.mark.parametrize("modules, moved", [
    (("norms",), {"model.norm.weight", "model.layers.0.input_layernorm.weight"}),
    (("embeddings",), {"model.embed_tokens.weight"}),
    (("output",), {"lm_head.weight"}),
    (("embeddings", "norms", "output"), {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"}),
])
def test_table4_state_free_modules(llama, modules, moved):
    groups = param_groups(llama, state_free_modules=modules)
    _all_params_once(llama, groups)
    free = {n for meta, names in _named(llama, groups) if meta.get("always_state_free") for n in names}
    assert moved <= free
    assert _kinds(llama, free) == set(modules)
    assert not any("_proj" in n for n in free)  # projectable weights are never always-state-free


def test_gpt2_tied_weight_moves_with_embeddings_or_output(gpt2):
    for modules in (("embeddings",), ("output",)):
        free = {n for meta, names in _named(gpt2, param_groups(gpt2, modules))
                if meta.get("always_state_free") for n in names}
        assert "transformer.wte.weight" in free


def test_unknown_state_free_module(llama):
    with pytest.raises(ValueError, match=r"linear.*embeddings.*norms.*output"):
        param_groups(llama, state_free_modules=["linear"])


def test_model_without_blocks_explains_how_to_pass_groups():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    with pytest.raises(ValueError, match=r"No projectable weights.*target_modules.*'projectable': True"):
        param_groups(model)


def test_frozen_parameters_left_out(llama):
    llama.model.embed_tokens.weight.requires_grad_(False)
    try:
        listed = {id(p) for g in param_groups(llama) for p in g["params"]}
        assert id(llama.model.embed_tokens.weight) not in listed
    finally:
        llama.model.embed_tokens.weight.requires_grad_(True)


def test_kinds_of_non_projectable_tensors(llama, gpt2):
    kinds = {r.name: r.kinds for r in module_roles(llama)}
    assert kinds["model.layers.2.post_attention_layernorm.weight"] == {"norms"}
    assert kinds["lm_head.weight"] == {"output"} and kinds["model.embed_tokens.weight"] == {"embeddings"}
    kinds = {r.name: r.kinds for r in module_roles(gpt2)}
    assert kinds["transformer.h.1.attn.c_attn.bias"] == {"bias"}
    assert kinds["transformer.wte.weight"] == {"embeddings", "output"}  # tied with lm_head


# ---- model families: the block-internal 2-D weights, found from the structure ----------------------
# Per family: a tiny config (4 layers, T5 2 + 2) and, written independently of frugal's rules, the
# projectable weights as a regex with the layer index as group "i" (T5: "stack" picks the offset).
_FAMILIES = {
    "llama": (lambda: _llama(4),
        r"model\.layers\.(?P<i>\d+)\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight"),
    "qwen2": (lambda: tf.Qwen2ForCausalLM(tf.Qwen2Config(
        hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=4,
        vocab_size=64, max_position_embeddings=32)),
        r"model\.layers\.(?P<i>\d+)\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight"),
    "phi3": (lambda: tf.Phi3ForCausalLM(tf.Phi3Config(
        hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=4,
        vocab_size=64, max_position_embeddings=32, pad_token_id=0)),
        r"model\.layers\.(?P<i>\d+)\.(self_attn\.(qkv|o)_proj|mlp\.(gate_up|down)_proj)\.weight"),
    "opt": (lambda: tf.OPTForCausalLM(tf.OPTConfig(
        hidden_size=32, ffn_dim=64, num_attention_heads=4, num_hidden_layers=4, vocab_size=64,
        max_position_embeddings=32, word_embed_proj_dim=32)),
        r"model\.decoder\.layers\.(?P<i>\d+)\.(self_attn\.(q|k|v|out)_proj|fc1|fc2)\.weight"),
    "gpt_neox": (lambda: tf.GPTNeoXForCausalLM(tf.GPTNeoXConfig(
        hidden_size=32, intermediate_size=64, num_attention_heads=4, num_hidden_layers=4, vocab_size=64,
        max_position_embeddings=32)),
        r"gpt_neox\.layers\.(?P<i>\d+)\.(attention\.(query_key_value|dense)|mlp\.dense_(h_to_4h|4h_to_h))\.weight"),
    "bert": (lambda: tf.BertForMaskedLM(tf.BertConfig(
        hidden_size=32, intermediate_size=64, num_attention_heads=4, num_hidden_layers=4, vocab_size=64,
        max_position_embeddings=32)),
        r"bert\.encoder\.layer\.(?P<i>\d+)\.(attention\.self\.(query|key|value)|attention\.output\.dense"
        r"|intermediate\.dense|output\.dense)\.weight"),
    "roberta": (lambda: tf.RobertaForMaskedLM(tf.RobertaConfig(
        hidden_size=32, intermediate_size=64, num_attention_heads=4, num_hidden_layers=4, vocab_size=64,
        max_position_embeddings=40)),
        r"roberta\.encoder\.layer\.(?P<i>\d+)\.(attention\.self\.(query|key|value)|attention\.output\.dense"
        r"|intermediate\.dense|output\.dense)\.weight"),
    "t5": (lambda: tf.T5ForConditionalGeneration(tf.T5Config(
        d_model=32, d_ff=64, d_kv=8, num_heads=4, num_layers=2, num_decoder_layers=2, vocab_size=64)),
        r"(?P<stack>encoder|decoder)\.block\.(?P<i>\d+)\.layer\.\d\."
        r"((SelfAttention|EncDecAttention)\.[qkvo]|DenseReluDense\.w[io])\.weight"),
    "vit": (lambda: tf.ViTForImageClassification(tf.ViTConfig(
        hidden_size=32, intermediate_size=64, num_attention_heads=4, num_hidden_layers=4, image_size=16,
        patch_size=8, num_labels=3)),
        r"vit\.layers\.(?P<i>\d+)\.(attention\.[qkvo]_proj|mlp\.fc[12])\.weight"),
    "gpt2": (lambda: _gpt2(4), r"transformer\.h\.(?P<i>\d+)\.(attn\.c_(attn|proj)|mlp\.c_(fc|proj))\.weight"),
}
_BUILT = {}


def _family(name):
    if name not in _BUILT:
        torch.manual_seed(0)
        _BUILT[name] = _FAMILIES[name][0]()
    return _BUILT[name]


def _expected_blocks(name, model):
    """{parameter name: layer index} from the family's regex; T5's decoder layers follow the encoder's."""
    expected = {}
    for n, _ in model.named_parameters():
        match = re.fullmatch(_FAMILIES[name][1], n)
        if match:
            offset = 2 if match.groupdict().get("stack") == "decoder" else 0
            expected[n] = int(match["i"]) + offset
    return expected


@pytest.mark.parametrize("name", list(_FAMILIES))
def test_family_projectable_set_is_the_block_internal_matrices(name):
    model = _family(name)
    groups = param_groups(model)
    _all_params_once(model, groups)
    got = {n: meta["block"] for meta, names in _named(model, groups) if meta.get("projectable") for n in names}
    assert got == _expected_blocks(name, model)
    transposed = {meta["transposed"] for meta, _ in _named(model, groups) if meta.get("projectable")}
    assert transposed == {name == "gpt2"}


@pytest.mark.parametrize("name", list(_FAMILIES))
def test_family_state_at_density_quarter_is_appendix_d(name):
    """FRUGAL(model, density=0.25): round(0.25 * 4) = 1 layer state-full (descending: the top one,
    index 3). Appendix D: 2 floats per state-full value (AdamW's m and v) for every non-projectable
    tensor and the active layer's weights; plus the implementation's 4-byte step counter per tensor."""
    model = _family(name)
    expected = _expected_blocks(name, model)
    names = {id(p): n for n, p in model.named_parameters()}
    optimizer = frugal.FRUGAL(model, density=0.25, lr=1e-3)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()
    for p in model.parameters():
        p.grad = None
    full = [p for p in model.parameters() if names[id(p)] not in expected or expected[names[id(p)]] == 3]
    appendix_d_floats = 2 * sum(p.numel() for p in full)
    assert frugal.state_bytes(optimizer) == 4 * appendix_d_floats + 4 * len(full)
    assert frugal.state_bytes(optimizer) == frugal.estimate_state_bytes(model, "frugal", density=0.25)


@pytest.mark.parametrize("name", list(_FAMILIES))
def test_transformer_blocks_are_the_layers_transformers_keeps_whole(name):
    """The one rule (module structure) finds the layers transformers names per family among the
    modules it keeps whole (`_no_split_modules`: LlamaDecoderLayer, GPT2Block, T5Block, ...; BERT's
    also lists its embeddings), every module of those classes, in module order, and what FRUGAL
    numbers as blocks."""
    model = _family(name)
    blocks = transformer_blocks(model)
    classes = {type(b) for b in blocks}
    assert {c.__name__ for c in classes} <= set(model._no_split_modules)
    assert blocks == [m for m in model.modules() if type(m) in classes]
    index = {id(p): i for i, block in enumerate(blocks) for p in block.parameters()}
    assert {index[id(r.param)] for r in module_roles(model) if r.block is not None} == set(range(len(blocks)))
    assert all(index[id(r.param)] == r.block for r in module_roles(model) if r.block is not None)


def test_a_new_model_family_needs_no_name_table():
    """A family nobody registered: its blocks, their count in models.count_parameters and FRUGAL's
    split come from the structure alone."""
    import models

    class Mixer(nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down, self.norm = nn.Linear(8, 16), nn.Linear(16, 8), nn.LayerNorm(8)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.trunk, self.head = (nn.Embedding(10, 8), nn.ModuleList(Mixer() for _ in range(3)),
                                                 nn.Linear(8, 10))

    model = Net()
    assert transformer_blocks(model) == list(model.trunk)
    assert models.count_parameters(model)["linear_in_blocks"] == 3 * 2 * 8 * 16
    with pytest.raises(ValueError, match="found no transformer blocks in Sequential"):
        transformer_blocks(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))


def test_t5_numbers_encoder_then_decoder():
    model = _family("t5")
    assert block_lists(model) == ["encoder.block", "decoder.block"]
    roles = {r.name: r.block for r in module_roles(model)}
    assert roles["encoder.block.1.layer.1.DenseReluDense.wo.weight"] == 1
    assert roles["decoder.block.0.layer.1.EncDecAttention.q.weight"] == 2
    # the relative position bias (an Embedding inside block 0) stays state-full
    assert roles["encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"] is None


def test_torch_transformer_encoder_multihead_attention():
    layer = nn.TransformerEncoderLayer(d_model=16, nhead=2, dim_feedforward=32, batch_first=True)
    model = nn.Sequential(nn.Embedding(10, 16), nn.TransformerEncoder(layer, num_layers=3), nn.Linear(16, 10))
    got = {r.name: r.block for r in module_roles(model) if r.block is not None}
    expected = {f"1.layers.{i}.{w}": i for i in range(3)
                for w in ("self_attn.in_proj_weight", "self_attn.out_proj.weight", "linear1.weight", "linear2.weight")}
    assert got == expected


# ---- target_modules: the PEFT-style override ------------------------------------------------------
def _projectable_names(model, groups):
    return {n for meta, names in _named(model, groups) if meta.get("projectable") for n in names}


def test_target_modules_names_regex_and_containers(llama):
    qv = _projectable_names(llama, param_groups(llama, target_modules=["q_proj", "v_proj"]))
    assert qv == {f"model.layers.{i}.self_attn.{x}_proj.weight" for i in range(3) for x in "qv"}
    mlp = _projectable_names(llama, param_groups(llama, target_modules=["mlp"]))  # a container
    assert mlp == {f"model.layers.{i}.mlp.{x}_proj.weight" for i in range(3) for x in ("gate", "up", "down")}
    regex = _projectable_names(llama, param_groups(llama, target_modules=r"model\.layers\.[01]\.self_attn\.o_proj"))
    assert regex == {"model.layers.0.self_attn.o_proj.weight", "model.layers.1.self_attn.o_proj.weight"}
    # "k" is not a suffix of any module name: "k_proj" would be
    with pytest.raises(ValueError, match=r"target_modules \['k'\] matched no.*model\.layers\.0\.self_attn\.q_proj"):
        param_groups(llama, target_modules=["k"])
    with pytest.raises(ValueError, match="regular expression"):
        param_groups(llama, target_modules="(")


def test_target_modules_outside_blocks_form_blocks_of_their_own():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    groups = param_groups(model, target_modules=["0", "2"])
    assert [(g["block"], len(g["params"])) for g in groups if g["projectable"]] == [(0, 1), (1, 1)]
    assert {id(model[4].weight), id(model[0].bias)} <= {id(p) for g in groups if not g["projectable"]
                                                        for p in g["params"]}
