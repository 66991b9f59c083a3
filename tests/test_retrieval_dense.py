"""DenseRetriever with the packaged all-MiniLM-L6-v2 weights on a few dozen passages."""
import json
import os
import pickle

import numpy as np
import pytest

from lldslight.retrieval import DenseRetriever, RetrievalError, load_index
from lldslight.retrieval.cli import index_main
from lldslight.retrieval.dense import TextEncoder, resolve_encoder
from lldslight.retrieval.index import CONFIG_NAME

os.environ.setdefault("HF_HUB_OFFLINE", "1")

FACTS = [
    ("Paris", "Paris is the capital and most populous city of France."),
    ("Berlin", "Berlin is the capital of Germany and its largest city."),
    ("Tokyo", "Tokyo is the capital of Japan."),
    ("Mount Everest", "Mount Everest is Earth's highest mountain above sea level."),
    ("Amazon River", "The Amazon is the largest river in South America by discharge."),
    ("Marie Curie", "Marie Curie did pioneering research on radioactivity and won two Nobel Prizes."),
    ("Python (programming language)", "Python is a programming language created by Guido van Rossum."),
    ("Great Wall of China", "The Great Wall is a series of fortifications across northern China."),
    ("Photosynthesis", "Plants turn sunlight, water and carbon dioxide into sugar and oxygen."),
    ("Jupiter", "Jupiter is the largest planet in the Solar System."),
    ("Violin", "The violin is a wooden string instrument played with a bow."),
    ("Penguin", "Penguins are flightless seabirds living mostly in the Southern Hemisphere."),
    ("Coffee", "Coffee is a brewed drink prepared from roasted coffee beans."),
    ("Football", "Association football is a team sport played with a spherical ball between two teams of eleven."),
    ("Volcano", "A volcano is a rupture in the crust where lava, ash and gases escape."),
    ("Shakespeare", "William Shakespeare was an English playwright who wrote Hamlet and Macbeth."),
    ("Chess", "Chess is a board game for two players on a checkered board of 64 squares."),
    ("Antarctica", "Antarctica is Earth's southernmost and coldest continent."),
    ("Bicycle", "A bicycle is a pedal-driven, two-wheeled vehicle."),
    ("Honey", "Honey is a sweet food made by bees from flower nectar."),
    ("Moon", "The Moon is Earth's only natural satellite."),
    ("Insulin", "Insulin is a hormone that regulates blood sugar levels."),
    ("Sahara", "The Sahara is the largest hot desert in the world, in North Africa."),
    ("Internet", "The Internet is a global network of interconnected computer networks."),
]
QUESTIONS = [
    ("Which city is the capital of Japan?", "Tokyo"),
    ("tallest mountain in the world", "Mount Everest"),
    ("Who wrote Hamlet?", "Shakespeare"),
    ("What do bees produce?", "Honey"),
    ("coldest continent", "Antarctica"),
    ("hormone controlling glucose in the blood", "Insulin"),
    ("biggest planet", "Jupiter"),
    ("birds that cannot fly in the southern oceans", "Penguin"),
]


def write_corpus(path, facts=FACTS):
    path.write_text("".join(json.dumps({"id": f"d{i}", "contents": f'"{t}"\n{x}'}) + "\n"
                            for i, (t, x) in enumerate(facts)))
    return path


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    d = tmp_path_factory.mktemp("dense")
    corpus = write_corpus(d / "c.jsonl")
    r = DenseRetriever(str(corpus), device="cpu", show_progress=False).load()
    return corpus, r


def test_packaged_encoder_resolves_offline():
    path = resolve_encoder("all-MiniLM-L6-v2")
    assert os.path.isfile(os.path.join(path, "model.safetensors"))
    assert resolve_encoder("sentence-transformers/all-MiniLM-L6-v2") == path
    assert resolve_encoder("intfloat/e5-base-v2") == "intfloat/e5-base-v2"


def test_semantic_search_finds_the_right_passage(built):
    _, r = built
    res = r.search([q for q, _ in QUESTIONS], 3)
    assert [ps[0].title for ps in res] == [t for _, t in QUESTIONS]
    for ps in res:
        assert len(ps) == 3 and ps[0].score >= ps[1].score >= ps[2].score
        assert -1.0 <= ps[2].score <= ps[0].score <= 1.0 + 1e-5  # normalised: cosine similarity
    assert len(r.search(["anything"], 100)[0]) == len(FACTS)  # k clamped to the corpus


def test_embeddings_match_sentence_transformers():
    st = pytest.importorskip("sentence_transformers")
    texts = ["a short one", "The Great Wall is a series of fortifications across northern China. " * 3]
    ours = TextEncoder("all-MiniLM-L6-v2", device="cpu").encode(texts)
    ref = st.SentenceTransformer(resolve_encoder("all-MiniLM-L6-v2"), device="cpu").encode(texts)
    np.testing.assert_allclose(ours, ref, atol=1e-5)


def test_lazy_cached_and_rebuilt_on_change(built, tmp_path):
    corpus = write_corpus(tmp_path / "c.jsonl", FACTS[:12])
    r = DenseRetriever(str(corpus), device="cpu", show_progress=False)
    assert not r.loaded and sorted(os.listdir(tmp_path)) == ["c.jsonl"]
    r.load()
    assert r.build_count == 1
    again = DenseRetriever(str(corpus), device="cpu", show_progress=False).load()
    assert again.build_count == 0 and again.index_path == r.index_path
    write_corpus(corpus, FACTS[:12] + [("Kangaroo", "Kangaroos are marsupials from Australia that hop.")])
    fresh = DenseRetriever(str(corpus), device="cpu", show_progress=False)
    assert fresh.search(["hopping Australian animal"], 1)[0][0].title == "Kangaroo"
    assert fresh.build_count == 1 and not r.index_path.exists()


def test_hnsw_index_and_e5_style_prefixes(tmp_path):
    corpus = write_corpus(tmp_path / "c.jsonl")
    r = DenseRetriever(str(corpus), index_type="hnsw", query_prefix="query: ", passage_prefix="passage: ",
                       device="cpu", show_progress=False)
    assert r.search(["Who wrote Macbeth?"], 2)[0][0].title == "Shakespeare"
    assert DenseRetriever(encoder="intfloat/e5-base-v2", corpus="x").query_prefix == "query: "
    assert DenseRetriever(encoder="intfloat/e5-base-v2", corpus="x").passage_prefix == "passage: "
    assert DenseRetriever(corpus="x").query_prefix == ""


def test_explicit_index_via_cli(tmp_path, capsys):
    corpus = write_corpus(tmp_path / "c.jsonl")
    out = tmp_path / "idx"
    rc = index_main(["--corpus", str(corpus), "--retriever", "dense", "--out", str(out), "--quiet",
                     "--query-prefix", "Q: ", "--device", "cpu"])
    assert rc == 0 and f"{len(FACTS)} passages" in capsys.readouterr().out
    cfg = json.loads((out / CONFIG_NAME).read_text())
    assert cfg["retriever"] == "dense" and cfg["settings"]["encoder"] == "all-MiniLM-L6-v2"
    assert cfg["query_settings"]["query_prefix"] == "Q: " and cfg["corpus"]["count"] == len(FACTS)
    r = load_index(str(out), device="cpu")
    assert isinstance(r, DenseRetriever) and r.query_prefix == "Q: "
    assert r.search(["What do bees produce?"], 1)[0][0].title == "Honey"
    copy = pickle.loads(pickle.dumps(r))  # what a worker process receives: settings, no model
    assert copy._encoder is None and copy.search(["coldest continent"], 1)[0][0].title == "Antarctica"
    assert copy.build_count == 0
    with pytest.raises(RetrievalError, match="max_seq_length: index has 256, retriever has 128"):
        DenseRetriever(index_dir=str(out), max_seq_length=128).load()


def test_unloadable_encoder_is_a_clear_error(tmp_path):
    corpus = write_corpus(tmp_path / "c.jsonl", FACTS[:3])
    r = DenseRetriever(str(corpus), encoder=str(tmp_path / "no-such-model"), device="cpu", show_progress=False)
    with pytest.raises(RetrievalError, match="cannot load encoder"):
        r.load()
