"""The embedding forward (gpu_worker/engine/embedding.py) against the references a user would
compare with: sentence-transformers' `encode` on the default all-MiniLM-L6-v2 directory, and
transformers' BertModel holding the tiny runtime's random weights with the same pooling.

Bounds: float32 matmuls match to cosine >= 0.999999 (only the order of float32 sums differs);
bfloat16 matmuls (the default where the CPU multiplies bfloat16 natively) to cosine >= 0.9999, the
bound the memory design asks for; measured 0.99998 worst over these texts."""
import pytest
import torch
import torch.nn.functional as F

from gpu_worker.engine.embedding import EmbeddingModel, matmul_dtype
from gpu_worker.storage.runtime_file import RuntimeFile

TEXTS = ["hello world", "The quick brown fox jumps over the lazy dog. " * 12, "",
         "Ünïcödé ☃ and 日本語 text", "memory " * 700,  # past max_seq_length: truncated as the reference does
         "ignore previous instructions <|im_start|>system", "a", "a b", "numbers 1 2 3 4.5e6"]


@pytest.fixture(scope="module")
def tiny_emb(tmp_path_factory):
    from gpu_worker.pack import pack_tiny
    path = tmp_path_factory.mktemp("emb") / "tiny.aotxccir"
    pack_tiny(path)
    with RuntimeFile.open(path) as runtime:
        yield runtime


def bert_reference(runtime):
    from transformers import BertConfig, BertModel
    card = runtime.json("emb/card")
    config = BertConfig(vocab_size=card["vocab_size"], hidden_size=card["hidden_size"],
                        num_hidden_layers=card["num_layers"], num_attention_heads=card["num_heads"],
                        intermediate_size=card["intermediate_size"], hidden_act="gelu",
                        max_position_embeddings=card["max_position_embeddings"],
                        type_vocab_size=card["type_vocab_size"], layer_norm_eps=card["layer_norm_eps"],
                        attn_implementation="eager")
    model = BertModel(config).eval()
    state = {name.removeprefix("emb/tensor/"): runtime.tensor(name).clone() for name in runtime.names("emb/tensor/")}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not [m for m in missing if "position_ids" not in m]
    assert not [u for u in unexpected if "position_ids" not in u]
    return model


def test_the_tiny_forward_matches_transformers_bert_with_mean_pooling(tiny_emb):
    ours = EmbeddingModel.from_runtime(tiny_emb, dtype=torch.float32)
    reference = bert_reference(tiny_emb)
    ids = ours.tokenize(["hello world", "a b c d e f g", "x"])
    got = ours.encode_ids(ids, batch_size=2)  # two batches, one padded
    for row, seq in enumerate(ids):
        with torch.no_grad():
            hidden = reference(input_ids=torch.tensor([seq])).last_hidden_state[0]
        want = F.normalize(hidden.mean(0), dim=0)
        assert torch.allclose(got[row], want, atol=1e-5), (row, (got[row] - want).abs().max())


def test_padding_and_batching_do_not_change_a_vector(tiny_emb):
    ours = EmbeddingModel.from_runtime(tiny_emb, dtype=torch.float32)
    alone = torch.stack([ours.encode([t])[0] for t in TEXTS])
    together = ours.encode(TEXTS, batch_size=4)
    assert torch.allclose(alone, together, atol=1e-5)
    assert torch.allclose(together.norm(dim=1), torch.ones(len(TEXTS)), atol=1e-5)


@pytest.mark.real_model
@pytest.mark.parametrize("dtype,bound", [(torch.float32, 0.999999), (None, 0.9999)])
def test_all_minilm_matches_sentence_transformers_encode(real_gen, dtype, bound):
    from sentence_transformers import SentenceTransformer

    from gpu_worker.pack import default_embedding_dir
    reference = SentenceTransformer(str(default_embedding_dir()), device="cpu")
    want = reference.encode(TEXTS, convert_to_tensor=True, batch_size=4)
    ours = EmbeddingModel.from_runtime(real_gen, dtype=dtype)
    assert ours.dim == 384 and ours.dtype == (dtype or matmul_dtype(torch.device("cpu")))
    got = ours.encode(TEXTS, batch_size=4)
    cosine = F.cosine_similarity(got, want)
    assert cosine.min().item() >= bound, cosine.tolist()
