"""The synthetic knowledge base of the embedded demo (docs/data_and_retrieval.md, Formats).

Fictional countries, cities, organisations, people and works with invented, syllable-composed
names, short Wikipedia-style passages ("Title"\\ntext) and 1-hop / 2-hop / comparison questions.
Every answer is a fact invented here, so a model can only get it by searching; every question
names an entity whose own passage a BM25 search on that name finds. Everything comes from one
``random.Random(seed)``, so the same seed gives byte-identical files, written through the same
writers (and read back through the same loaders) as real data.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from lldslight.data.example import QAExample
from lldslight.errors import ConfigError, UserError, require
from lldslight.data.formats import (
    format_passage,
    template_messages,
    write_corpus_jsonl,
    write_flashrag_jsonl,
    write_searchr1_parquet,
)
from lldslight.run.writes import check_writable, write_failure

# Bump when the generator's output changes, so stale knowledge bases are regenerated.
GENERATOR_VERSION = 1
SPLITS = ("train", "dev", "test")
QUESTION_TYPES = ("1hop", "2hop", "comparison")

# Names are onset+nucleus syllables with an optional final coda. Each name must contain one of
# RARE_CLUSTERS: English words almost never do, which keeps names from being real words the
# model might already "know" something about.
_ONSETS = ["b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "th", "dr", "kr", "br",
           "tr", "sk", "kv", "zh", "vr", "kh", "dv", "vl"]
_NUCLEI = ["a", "e", "i", "o", "u", "a", "e", "o", "ae", "y"]
_CODAS = ["", "", "n", "r", "l", "s", "x", "th", "rn", "sk", "v"]
RARE_CLUSTERS = ("kv", "zh", "vr", "kh", "dv", "vl", "ae", "yr", "yl", "yn", "ix", "ox", "aex", "thr", "vn")

_PROFESSIONS = ["chemist", "engineer", "architect", "physician", "astronomer", "botanist", "merchant",
                "geologist", "cartographer", "banker"]
_WORK_KINDS = {
    # kind: (creator profession, creator noun, creating verb, "who ..." verb, year verb)
    "novel": ("novelist", "author", "written by", "wrote", "published"),
    "painting": ("painter", "painter", "by", "painted", "completed"),
    "symphony": ("composer", "composer", "composed by", "composed", "first performed"),
    "film": ("film director", "director", "directed by", "directed", "released"),
}
_WORK_NOUNS = ["Garden", "Lantern", "River", "Winter", "Harbour", "Orchard", "Tower", "Bridge", "Mirror",
               "Voyage", "Silence", "Festival", "Shore", "Crown", "Meadow", "Storm"]
_ORG_KINDS = [
    # (suffix, description, what it is known for)
    ("Labs", "research laboratory", "its work on soil chemistry"),
    ("Press", "publishing house", "its illustrated atlases"),
    ("Shipping", "shipping company", "its river freighters"),
    ("Institute", "research institute", "its long-running weather records"),
    ("Works", "engineering firm", "its iron bridges"),
    ("Bank", "bank", "its small loans to farmers"),
    ("Records", "record label", "its recordings of folk choirs"),
    ("Theatre", "theatre company", "its winter touring season"),
]
_CITY_FEATURES = ["stone bridges", "salt markets", "glass workshops", "clock tower", "river harbour",
                  "spring fair", "old university", "copper mines", "terraced vineyards", "lighthouse"]
_PERSON_FILLERS = [
    "{Pron} is remembered for careful work and long letters to colleagues.",
    "{Pron} spent most of {pos} life travelling between small towns.",
    "Friends described {obj} as patient, quiet and stubborn.",
    "{Pron} kept detailed notebooks that survive to this day.",
]
_WORK_FILLERS = [
    "Critics praised its calm pace and its unusual ending, and it is still studied in schools.",
    "It was little noticed at first but later became widely admired across the region.",
    "It is often cited as the finest work of its creator and has been copied many times.",
    "A restored version was presented many years later to a large and curious audience.",
]


@dataclass
class Country:
    name: str
    region: str
    population_m: float
    cities: list["City"] = field(default_factory=list)
    capital: Optional["City"] = None


@dataclass
class City:
    name: str
    country: Country
    founded: int
    population: int
    feature: str


@dataclass
class Org:
    name: str
    kind: str
    known_for: str
    founded: int
    hq: City
    staff: int
    founder: Optional["Person"] = None


@dataclass
class Person:
    name: str
    surname: str
    pronoun: str  # "he" / "she"
    birth_year: int
    birth_city: City
    profession: str
    founded: Optional[Org] = None
    employer: Optional[Org] = None
    works: list["Work"] = field(default_factory=list)


@dataclass
class Work:
    title: str
    kind: str
    year: int
    creator: Person


@dataclass
class World:
    countries: list[Country]
    cities: list[City]
    orgs: list[Org]
    people: list[Person]
    works: list[Work]


# ----------------------------------------------------------------------------- names


class _Namer:
    """Unique invented words; every word is distinct from every other (names never share a token)."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.used: set[str] = set()

    def word(self, syllables: tuple[int, int] = (2, 2)) -> str:
        # Short names: a 135M model must copy them into a search query and an answer.
        while True:
            n = self.rng.randint(*syllables)
            w = "".join(self.rng.choice(_ONSETS) + self.rng.choice(_NUCLEI) for _ in range(n))
            if self.rng.random() < 0.2:
                w = w[len(w) - len(w.lstrip("bcdfghjklmnpqrstvwxz")):]  # vowel-initial now and then
            w += self.rng.choice(_CODAS)
            if len(w) < 4 or len(w) > 9 or not any(c in w for c in RARE_CLUSTERS) or w in self.used:
                continue
            self.used.add(w)
            return w.capitalize()


def _fmt_int(n: int) -> str:
    return f"{n:,}"


# ----------------------------------------------------------------------------- world


def build_world(seed: int, entities: int) -> World:
    """Sample the fictional world; ``entities`` counts every entity that gets a passage."""
    require(entities >= 20, "data.synthesize.entities (--entities)", ">= 20", entities,
            "fewer are too few for 2-hop and comparison questions")
    rng = random.Random(seed)
    namer = _Namer(rng)
    n_countries = max(3, round(entities * 0.05))
    n_cities = max(2 * n_countries, round(entities * 0.2))
    n_orgs = round(entities * 0.2)
    n_works = round(entities * 0.2)
    n_people = entities - n_countries - n_cities - n_orgs - n_works
    regions = [namer.word((2, 2)) for _ in range(max(2, n_countries // 3))]

    countries = [Country(namer.word(), rng.choice(regions), round(rng.uniform(0.4, 30.0), 1)) for _ in range(n_countries)]
    cities = []
    for i in range(n_cities):
        # Round-robin first so every country has cities, then random.
        country = countries[i] if i < n_countries else rng.choice(countries)
        city = City(namer.word(), country, rng.randint(800, 1850), rng.randint(5, 900) * 1000, rng.choice(_CITY_FEATURES))
        country.cities.append(city)
        cities.append(city)
    for c in countries:
        c.capital = max(c.cities, key=lambda x: x.population)

    first_names = [namer.word((2, 2)) for _ in range(max(8, n_people // 3))]
    people = []
    for _ in range(n_people):
        surname = namer.word()
        people.append(
            Person(
                name=f"{rng.choice(first_names)} {surname}",
                surname=surname,
                pronoun=rng.choice(["he", "she"]),
                birth_year=rng.randint(1820, 1980),
                birth_city=rng.choice(cities),
                profession="",
            )
        )

    # Creators take the profession of their kind of work; founders of organisations are drawn
    # from the rest first, so most people have one role that their passage can state plainly.
    order = list(range(n_people))
    rng.shuffle(order)
    kinds = list(_WORK_KINDS)
    n_creators = max(1, min(n_people // 3, n_works))
    creators = [people[i] for i in order[:n_creators]]
    others = [people[i] for i in order[n_creators:]]
    for p in creators:
        p.profession = _WORK_KINDS[rng.choice(kinds)][0]
    for p in others:
        p.profession = rng.choice(_PROFESSIONS)

    works = []
    for i in range(n_works):
        creator = creators[i] if i < len(creators) else rng.choice(creators)
        kind = next(k for k, v in _WORK_KINDS.items() if v[0] == creator.profession)
        core = namer.word()
        title = f"The {rng.choice(_WORK_NOUNS)} of {core}" if rng.random() < 0.5 else f"{core} {rng.choice(_WORK_NOUNS)}"
        w = Work(title, kind, creator.birth_year + rng.randint(22, 60), creator)
        creator.works.append(w)
        works.append(w)

    founders = others + creators  # others first: creators found organisations only when needed
    orgs = []
    for i in range(n_orgs):
        suffix, desc, known = rng.choice(_ORG_KINDS)
        founder = founders[i % len(founders)]
        org = Org(f"{namer.word()} {suffix}", desc, known, 0, rng.choice(cities), rng.randint(2, 90) * 10)
        if founder.founded is None:
            org.founder = founder
            founder.founded = org
            org.founded = founder.birth_year + rng.randint(25, 55)
        else:  # more organisations than people: found it without a named founder
            org.founded = rng.randint(1850, 2010)
        orgs.append(org)
    for p in people:
        if p.founded is None and orgs:
            p.employer = rng.choice(orgs)
    return World(countries, cities, orgs, people, works)


# ----------------------------------------------------------------------------- passages


def _person_passage(p: Person, rng: random.Random) -> str:
    pron, pos, obj = (("He", "his", "him") if p.pronoun == "he" else ("She", "her", "her"))
    parts = [f"{p.name} (born {p.birth_year}) is a {p.profession}.",
             f"{p.surname} was born in {p.birth_city.name}."]
    if p.founded is not None:
        parts.append(f"{pron} founded {p.founded.name} in {p.founded.founded}.")
    elif p.employer is not None:
        parts.append(f"{pron} works for {p.employer.name}.")
    if p.works:
        w = p.works[0]
        parts.append(f"{pos.capitalize()} best known {w.kind} is {w.title}.")
    parts.append(rng.choice(_PERSON_FILLERS).format(Pron=pron, pos=pos, obj=obj))
    return format_passage(p.name, " ".join(parts))


def _city_passage(c: City, rng: random.Random) -> str:
    capital = c.country.capital is c
    other = rng.choice([f for f in _CITY_FEATURES if f != c.feature])
    parts = [f"{c.name} is {'the capital' if capital else 'a city'} of {c.country.name}.",
             f"It was founded in {c.founded} and has a population of {_fmt_int(c.population)}.",
             f"{c.name} is known for its {c.feature}, and visitors often come for its {other}."]
    return format_passage(c.name, " ".join(parts))


def _country_passage(k: Country, rng: random.Random) -> str:
    assert k.capital is not None
    others = [c.name for c in k.cities if c is not k.capital][:2]
    parts = [f"{k.name} is a country in the {k.region} region.",
             f"Its capital and largest city is {k.capital.name}.",
             f"{k.name} has a population of about {k.population_m} million."]
    if others:
        parts.append(f"Other cities include {' and '.join(others)}.")
    return format_passage(k.name, " ".join(parts))


def _org_passage(o: Org, rng: random.Random) -> str:
    by = f" by {o.founder.name}" if o.founder is not None else ""
    parts = [f"{o.name} is a {o.kind} founded in {o.founded}{by}.",
             f"Its headquarters are in {o.hq.name}.",
             f"It employs about {o.staff} people and is known for {o.known_for}."]
    return format_passage(o.name, " ".join(parts))


def _work_passage(w: Work, rng: random.Random) -> str:
    _, _, made_by, _, year_verb = _WORK_KINDS[w.kind]
    parts = [f"{w.title} is a {w.kind} {made_by} {w.creator.name}.",
             f"It was {year_verb} in {w.year}.",
             rng.choice(_WORK_FILLERS)]
    return format_passage(w.title, " ".join(parts))


def build_corpus(world: World, rng: random.Random) -> list[dict]:
    """Passages of every entity, shuffled (so corpus position says nothing), ids "0".."N-1"."""
    contents = (
        [_country_passage(k, rng) for k in world.countries]
        + [_city_passage(c, rng) for c in world.cities]
        + [_org_passage(o, rng) for o in world.orgs]
        + [_person_passage(p, rng) for p in world.people]
        + [_work_passage(w, rng) for w in world.works]
    )
    rng.shuffle(contents)
    return [{"id": str(i), "contents": c} for i, c in enumerate(contents)]


# ----------------------------------------------------------------------------- questions


@dataclass
class _Q:
    type: str
    relation: str
    question: str
    answers: list[str]
    supporting: list[str]  # titles of the passages that hold the facts, hop order


def _person_answers(p: Person) -> list[str]:
    return [p.name, p.surname]


def _one_hop(world: World, rng: random.Random) -> list[_Q]:
    qs: list[_Q] = []

    def add(rel: str, templates: list[str], answers: list[str], title: str, **kw: str) -> None:
        qs.append(_Q("1hop", rel, rng.choice(templates).format(**kw), answers, [title]))

    for p in world.people:
        add("born_in", ["In which city was {x} born?", "Where was {x} born?", "What is the birthplace of {x}?"],
            [p.birth_city.name], p.name, x=p.name)
        add("birth_year", ["In what year was {x} born?", "When was {x} born?"], [str(p.birth_year)], p.name, x=p.name)
        add("profession", ["What is the profession of {x}?", "What does {x} do for a living?"],
            [p.profession], p.name, x=p.name)
        if p.employer is not None:
            add("works_for", ["Which organisation does {x} work for?", "Who is the employer of {x}?"],
                [p.employer.name], p.name, x=p.name)
    for o in world.orgs:
        if o.founder is not None:
            add("founded_by", ["Who founded {x}?", "Who is the founder of {x}?"], _person_answers(o.founder), o.name, x=o.name)
        add("founded_year", ["In what year was {x} founded?", "When was {x} founded?"], [str(o.founded)], o.name, x=o.name)
        add("headquartered_in", ["Where is {x} headquartered?", "In which city is {x} based?"], [o.hq.name], o.name, x=o.name)
    for w in world.works:
        _, noun, _, who_verb, year_verb = _WORK_KINDS[w.kind]
        add("created_by", ["Who " + who_verb + " {x}?", "Who is the " + noun + " of {x}?"],
            _person_answers(w.creator), w.title, x=w.title)
        add("work_year", ["In what year was {x} " + year_verb + "?"], [str(w.year)], w.title, x=w.title)
    for c in world.cities:
        add("in_country", ["In which country is {x}?", "{x} is a city in which country?"], [c.country.name], c.name, x=c.name)
        add("city_founded", ["When was the city of {x} founded?", "In what year was {x} founded?"],
            [str(c.founded)], c.name, x=c.name)
    for k in world.countries:
        assert k.capital is not None
        add("capital", ["What is the capital of {x}?", "Which city is the capital of {x}?"], [k.capital.name], k.name, x=k.name)
    return qs


def _two_hop(world: World, rng: random.Random) -> list[_Q]:
    qs: list[_Q] = []

    def add(rel: str, templates: list[str], answers: list[str], titles: list[str], **kw: str) -> None:
        qs.append(_Q("2hop", rel, rng.choice(templates).format(**kw), answers, titles))

    for o in world.orgs:
        f = o.founder
        if f is not None:
            add("founder_born_in", ["In which city was the founder of {x} born?", "Where was the founder of {x} born?"],
                [f.birth_city.name], [o.name, f.name], x=o.name)
            add("founder_birth_year", ["In what year was the founder of {x} born?"], [str(f.birth_year)], [o.name, f.name], x=o.name)
        add("hq_country", ["In which country is {x} headquartered?", "In which country are the headquarters of {x}?"],
            [o.hq.country.name], [o.name, o.hq.name], x=o.name)
    for w in world.works:
        noun = _WORK_KINDS[w.kind][1]
        add("creator_born_in", ["In which city was the " + noun + " of {x} born?", "Where was the " + noun + " of {x} born?"],
            [w.creator.birth_city.name], [w.title, w.creator.name], x=w.title)
    for p in world.people:
        add("birth_country", ["In which country was {x} born?"], [p.birth_city.country.name], [p.name, p.birth_city.name], x=p.name)
        if p.employer is not None and p.employer.founder is not None:
            add("employer_founder", ["Who founded the organisation that {x} works for?",
                                     "Who is the founder of the employer of {x}?"],
                _person_answers(p.employer.founder), [p.name, p.employer.name], x=p.name)
        if p.founded is not None:
            add("founded_org_hq", ["In which city is the organisation founded by {x} headquartered?"],
                [p.founded.hq.name], [p.name, p.founded.name], x=p.name)
    for k in world.countries:
        assert k.capital is not None
        add("capital_founded", ["In what year was the capital of {x} founded?"], [str(k.capital.founded)],
            [k.name, k.capital.name], x=k.name)
    return qs


def _comparisons(world: World, rng: random.Random, n: int) -> list[_Q]:
    """``n`` comparison questions over random pairs with distinct values; phrasing and order vary."""
    # (relation, entities, title, value, [(template, pick the larger value?)], answers of the winner)
    kinds = [
        ("born_earlier", world.people, lambda p: p.name, lambda p: p.birth_year,
         [("Who was born earlier, {a} or {b}?", False), ("Who was born first, {a} or {b}?", False),
          ("Who is older, {a} or {b}?", False), ("Who was born later, {a} or {b}?", True)], _person_answers),
        ("founded_first", world.orgs, lambda o: o.name, lambda o: o.founded,
         [("Which was founded first, {a} or {b}?", False), ("Which organisation is older, {a} or {b}?", False),
          ("Which was founded more recently, {a} or {b}?", True)], lambda o: [o.name]),
        ("population", world.cities, lambda c: c.name, lambda c: c.population,
         [("Which city has a larger population, {a} or {b}?", True), ("Which city is more populous, {a} or {b}?", True),
          ("Which city has fewer inhabitants, {a} or {b}?", False)], lambda c: [c.name]),
        ("city_older", world.cities, lambda c: c.name, lambda c: c.founded,
         [("Which city is older, {a} or {b}?", False), ("Which city was founded first, {a} or {b}?", False)],
         lambda c: [c.name]),
        ("work_first", world.works, lambda w: w.title, lambda w: w.year,
         [("Which came out first, {a} or {b}?", False), ("Which is more recent, {a} or {b}?", True)],
         lambda w: [w.title]),
    ]
    qs: list[_Q] = []
    seen: set[tuple[str, str, str]] = set()
    attempts = 0
    while len(qs) < n and attempts < 50 * n:
        attempts += 1
        rel, pool, title, value, templates, answers = kinds[len(qs) % len(kinds)]
        if len(pool) < 2:
            continue
        a, b = rng.sample(pool, 2)
        if value(a) == value(b) or (rel, title(a), title(b)) in seen:
            continue
        seen.add((rel, title(a), title(b)))
        template, larger = rng.choice(templates)
        winner = max((a, b), key=value) if larger else min((a, b), key=value)
        qs.append(_Q("comparison", rel, template.format(a=title(a), b=title(b)), answers(winner), [title(a), title(b)]))
    return qs


def build_questions(world: World, rng: random.Random, comparisons: int) -> list[_Q]:
    qs = _one_hop(world, rng) + _two_hop(world, rng) + _comparisons(world, rng, comparisons)
    unique: dict[str, _Q] = {}
    for q in qs:  # two facts can share a phrasing only by a name clash, which _Namer forbids
        unique.setdefault(q.question, q)
    return list(unique.values())


def split_questions(qs: list[_Q], rng: random.Random, dev: int, test: int) -> dict[str, list[_Q]]:
    """dev and test take the question types in turn (balanced per-type EM); train gets the rest."""
    by_type = {t: [q for q in qs if q.type == t] for t in QUESTION_TYPES}
    for t in QUESTION_TYPES:
        rng.shuffle(by_type[t])
    out: dict[str, list[_Q]] = {"dev": [], "test": []}
    for split, n in (("dev", dev), ("test", test)):
        while len(out[split]) < n and any(by_type.values()):
            for t in QUESTION_TYPES:
                if by_type[t] and len(out[split]) < n:
                    out[split].append(by_type[t].pop())
    train = [q for t in QUESTION_TYPES for q in by_type[t]]
    rng.shuffle(train)
    require(bool(train), "data.synthesize.dev + test (--dev, --test)", f"below the {len(qs)} questions generated "
            "(the rest are the training split)", dev + test, f"dev={dev} + test={test} leave no training questions")
    out["train"] = train
    return out


def _to_examples(qs: list[_Q], split: str) -> list[QAExample]:
    return [
        QAExample(
            id=f"synth_{split}_{i}",
            question=q.question,
            golden_answers=list(q.answers),
            data_source=f"synth_{q.type}",
            messages=template_messages(q.question),
            split=split,
            meta={"type": q.type, "relation": q.relation, "supporting_titles": list(q.supporting),
                  "extra_info": {"index": i, "split": split}},
        )
        for i, q in enumerate(qs)
    ]


# ----------------------------------------------------------------------------- files


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _paths(out: Path) -> dict[str, Path]:
    paths = {"corpus": out / "corpus.jsonl"}
    for s in SPLITS:
        paths[s] = out / f"{s}.parquet"
        paths[f"{s}_jsonl"] = out / f"{s}.jsonl"
    paths["manifest"] = out / "manifest.json"
    return paths


def _content_fingerprint(corpus: list[dict], splits: dict[str, list[QAExample]]) -> str:
    """Hash of the logical content, independent of the parquet library's byte layout."""
    h = hashlib.sha256()
    h.update(json.dumps(corpus, sort_keys=True).encode())
    for s in SPLITS:
        for ex in splits[s]:
            h.update(json.dumps([ex.id, ex.question, ex.golden_answers, ex.data_source, ex.meta], sort_keys=True).encode())
    return h.hexdigest()


def _manifest_matches(paths: dict[str, Path], args: dict, fingerprint: str) -> bool:
    try:
        m = json.loads(paths["manifest"].read_text())
    except (OSError, json.JSONDecodeError):
        return False
    if m.get("version") != GENERATOR_VERSION or m.get("args") != args or m.get("fingerprint") != fingerprint:
        return False
    files = m.get("files", {})
    return all(paths[k].is_file() and files.get(k) == _sha256(paths[k]) for k in paths if k != "manifest")


def _not_ours(paths: dict[str, Path]) -> list[str]:
    """The files at ``paths`` that exist and that no earlier synthesis recorded in its manifest:
    the user's own. (A recorded file that changed since is the generator's, damaged or stale, and
    is written again.)"""
    try:
        manifest = json.loads(paths["manifest"].read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        manifest = {}
    ours = manifest.get("files", {}) if isinstance(manifest, dict) and manifest.get("generator") == "lldslight.data.synth" else {}
    found = [k for k, p in paths.items()
             if k != "manifest" and p.exists() and (not p.is_file() or k not in ours)]
    if paths["manifest"].exists() and not ours:
        found.append("manifest")
    return [paths[k].name for k in found]


def synthesize(
    out_dir: str | os.PathLike,
    seed: int = 0,
    entities: int = 200,
    dev: int = 64,
    test: int = 64,
    comparisons: Optional[int] = None,
    force: bool = False,
) -> dict[str, Path]:
    """Write the knowledge base to ``out_dir`` unless a matching one is already there. Files of
    the same names that no earlier synthesis wrote (the user's own) are replaced only with ``force``.

    Files: corpus.jsonl, {train,dev,test}.parquet (Search-R1), {train,dev,test}.jsonl (FlashRAG),
    manifest.json (args, counts, content fingerprint, file hashes). ``comparisons`` defaults to
    ``entities``. Returns {"corpus", "train", "dev", "test", "train_jsonl", "dev_jsonl",
    "test_jsonl", "manifest"} -> path. Files are written under temporary names and renamed, the
    manifest last, so an interrupted run is redone rather than trusted.
    """
    out = Path(out_dir)
    paths = _paths(out)
    n_comp = entities if comparisons is None else comparisons
    args = {"seed": seed, "entities": entities, "dev": dev, "test": test, "comparisons": n_comp}

    # Generating is milliseconds; it is the only way to know what the files should contain.
    rng = random.Random(seed)
    world = build_world(rng.randrange(2**32), entities)
    corpus = build_corpus(world, random.Random(rng.randrange(2**32)))
    qrng = random.Random(rng.randrange(2**32))
    split_qs = split_questions(build_questions(world, qrng, n_comp), qrng, dev, test)
    splits = {s: _to_examples(split_qs[s], s) for s in SPLITS}
    fingerprint = _content_fingerprint(corpus, splits)
    if _manifest_matches(paths, args, fingerprint):
        return paths
    foreign = _not_ours(paths)
    if foreign and not force:
        raise ConfigError(f"{out} holds {', '.join(foreign)}, which this generator did not write; synthesizing would "
                          "replace them: choose another output directory (--out, "
                          "data.synthesize.out_dir), or pass --force to lldslight data synth")

    # A read-only or missing place is said now, naming the directory (it was an OSError traceback).
    check_writable(out, "the knowledge base (--out, data.synthesize.out_dir)")
    # Per-process names: two jobs that synthesise the same data at once (the lab builds its two
    # warm-start policies side by side) would otherwise rename each other's half-written files.
    tmp = {k: p.with_name(f"{p.name}.{os.getpid()}.tmp") for k, p in paths.items()}
    try:
        paths["manifest"].unlink(missing_ok=True)
        write_corpus_jsonl(corpus, tmp["corpus"])
        for s in SPLITS:
            write_searchr1_parquet(splits[s], tmp[s])
            write_flashrag_jsonl(splits[s], tmp[f"{s}_jsonl"])
        for k in paths:
            if k != "manifest":
                os.replace(tmp[k], paths[k])
        words = [len(r["contents"].split("\n", 1)[1].split()) for r in corpus]
        manifest = {
            "generator": "lldslight.data.synth",
            "version": GENERATOR_VERSION,
            "args": args,
            "counts": {
                "passages": len(corpus),
                "avg_passage_words": round(sum(words) / len(words), 1),
                "entities": {"countries": len(world.countries), "cities": len(world.cities), "organisations": len(world.orgs),
                             "people": len(world.people), "works": len(world.works)},
                **{s: {t: sum(ex.meta["type"] == t for ex in splits[s]) for t in QUESTION_TYPES} for s in SPLITS},
            },
            "fingerprint": fingerprint,
            "files": {k: _sha256(paths[k]) for k in paths if k != "manifest"},
        }
        tmp["manifest"].write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        os.replace(tmp["manifest"], paths["manifest"])
    except Exception as err:  # a full disk half-way: no manifest, so the next run writes the files again
        reason = write_failure(err)
        if reason is None:
            raise
        raise UserError(f"the knowledge base: cannot write {out}: {reason} (its manifest is not written: the next "
                        "synthesis writes every file again)") from None
    finally:
        for t in tmp.values():
            t.unlink(missing_ok=True)
    return paths
