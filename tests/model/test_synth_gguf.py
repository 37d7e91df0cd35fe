"""llama_grpc_testkit.synth_gguf: a random-weight Gemma 3 GGUF that llama.cpp loads, quantizes and
serves (the GPU benchmark makes its models this way on a machine that can fetch none)."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator
from pathlib import Path

import llama_cpp
import pytest

from llama_grpc_server.config import ModelSettings, SchedulerSettings, Settings
from llama_grpc_server.core.requests.request import (
    Finished,
    GenerationRequest,
    OutputParams,
    SamplingParams,
    StoppingParams,
)
from llama_grpc_server.engine.build import build_engine
from llama_grpc_server.engine.loop import EngineLoop
from llama_grpc_server.models.gguf_header import read_header
from llama_grpc_testkit import llama_sdist, synth_gguf
from llama_grpc_testkit.models import TINY_BOS, TINY_N_VOCAB, counting, tiny_model_file
from tests.support.families import (
    CORPUS,
    FAMILIES,
    Family,
    Reference,
    family_model,
    template_source,
)

from .conftest import make_tiny_engine, run, run_all


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("synth") / "tiny-f16.gguf"
    synth_gguf.write(synth_gguf.SHAPES["tiny"], path)
    return path


def test_the_tests_tiny_model_is_the_tiny_shape_written_once() -> None:
    """llama_grpc_testkit.models' tiny model: the `tiny` shape (its vocabulary size as the tests
    know it), cached: a second call returns the same file, not rewritten."""
    path = tiny_model_file()
    assert path == synth_gguf.counting_model() and path.parent == synth_gguf.models_dir()
    mtime = path.stat().st_mtime_ns
    assert tiny_model_file().stat().st_mtime_ns == mtime
    assert synth_gguf.SHAPES["counting"].n_vocab == TINY_N_VOCAB
    assert synth_gguf.BOS == TINY_BOS
    meta = read_header(path).metadata
    assert meta["general.architecture"] == "gemma3"
    assert meta["gemma3.embedding_length"] == synth_gguf.SHAPES["counting"].n_embd


def test_shapes_are_the_models_they_stand_for() -> None:
    assert synth_gguf.SHAPES["270m"].n_params == pytest.approx(268e6, rel=0.01)
    assert synth_gguf.SHAPES["1b"].n_params == pytest.approx(1.0e9, rel=0.01)


def test_header_describes_a_gemma3(tiny: Path) -> None:
    meta = read_header(tiny).metadata
    shape = synth_gguf.SHAPES["tiny"]
    assert meta["general.architecture"] == "gemma3"
    assert meta["gemma3.block_count"] == shape.n_layer
    assert meta["gemma3.attention.key_length"] == shape.head_dim
    assert meta["tokenizer.ggml.model"] == "llama"
    assert meta["tokenizer.ggml.tokens"].length == shape.n_vocab


def test_vocabulary_pieces_are_unique() -> None:
    tokens, scores, types = synth_gguf.vocabulary(2000)
    assert len(set(tokens)) == len(tokens) == len(scores) == len(types) == 2000
    assert tokens[synth_gguf.FIRST_PIECE] == "\u2581a".encode()


async def test_llama_cpp_quantizes_and_serves_it(tiny: Path) -> None:
    """Quantized to Q4_K_M by llama.cpp (the C API llama-quantize uses), then served by the
    engine: a token-id prompt generates max_tokens tokens with ignore_eos."""
    quantized = tiny.with_name("tiny-q4_k_m.gguf")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
    assert llama_cpp.llama_model_quantize(str(tiny).encode(), str(quantized).encode(), params) == 0
    assert read_header(quantized).metadata["general.file_type"] == 15  # MOSTLY_Q4_K_M
    settings = Settings(
        model=ModelSettings(model_path=str(quantized), n_ctx=512, n_batch=128, n_threads=1),
        scheduler=SchedulerSettings(n_parallel=2),
    )
    engine = await asyncio.to_thread(build_engine, settings)
    try:
        first = synth_gguf.FIRST_PIECE
        prompt = (synth_gguf.BOS, first, first + 7, first + 300)
        request = GenerationRequest(
            "synth",
            prompt,
            SamplingParams(temperature=0.0),
            StoppingParams(max_tokens=6, ignore_eos=True),
        )
        out = await run(engine, request)
        ids = out.token_ids
        assert isinstance(out.final, Finished)
        assert len(ids) == 6 and all(0 <= t < synth_gguf.SHAPES["tiny"].n_vocab for t in ids)
        assert engine.detokenize(prompt[1:], render_special=False) == " a h ko"
    finally:
        await asyncio.to_thread(engine.close)


# -- the counting model (the tests' tiny model) ----------------------------------------------------


def test_successor_counts_through_the_word_pieces_and_never_ends() -> None:
    n_vocab, first = TINY_N_VOCAB, synth_gguf.FIRST_PIECE
    n_words = n_vocab - first - len(synth_gguf.LETTERS)
    assert synth_gguf.successor(first, n_vocab) == first + 1
    assert synth_gguf.successor(first + n_words - 1, n_vocab) == first  # wraps
    assert synth_gguf.successor(TINY_BOS, n_vocab) == first + TINY_BOS
    assert synth_gguf.successor(n_vocab - 1, n_vocab) == first + (n_vocab - 1) % n_words
    images = {synth_gguf.successor(t, n_vocab) for t in range(n_vocab)}
    assert images == set(range(first, first + n_words)), "only word pieces, never EOS"
    tokens, _, _ = synth_gguf.vocabulary(n_vocab, letters=True)
    assert [t.decode() for t in tokens[-27:]] == list(synth_gguf.LETTERS)


async def test_the_counting_model_counts_by_wide_margins_whatever_the_batch() -> None:
    """Four greedy requests at once (prompts ending in a word piece, a byte, BOS and a letter):
    each generates exactly the successor chain of its last prompt token, every step's top-2
    logprob margin at least 5 nats (fault_support.SOUND_MARGIN is 2), batched or alone."""
    engine = make_tiny_engine(n_parallel=4)
    try:
        first = synth_gguf.FIRST_PIECE
        prompts = [(TINY_BOS, first + 5, first + 6), (TINY_BOS, 40, 41), (TINY_BOS,),
                   (TINY_BOS, first + 3, TINY_N_VOCAB - 1)]  # fmt: skip

        def greedy(i: int, prompt: tuple[int, ...]) -> GenerationRequest:
            return GenerationRequest(
                f"count-{i}", prompt, SamplingParams(temperature=0.0),
                StoppingParams(max_tokens=300, ignore_eos=True),
                output=OutputParams(logprobs=True, top_logprobs=2),
            )  # fmt: skip

        together = await run_all(engine, [greedy(i, p) for i, p in enumerate(prompts)])
        alone = [await run(engine, greedy(i, p)) for i, p in enumerate(prompts)]
        for prompt, batched, solo in zip(prompts, together, alone, strict=True):
            expected = counting(prompt[-1], 300)
            assert batched.token_ids == solo.token_ids == expected
            margins = [lp.top[0].logprob - lp.top[1].logprob for lp in batched.logprobs]
            assert len(margins) == 300 and min(margins) >= 5.0, min(margins)
    finally:
        await asyncio.to_thread(engine.close)


# -- families: real vocabularies and templates ----------------------------------------------------

TOKENIZER_ARRAYS = (
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.scores",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.merges",
)


def tokenizer_keys(path: Path) -> dict[str, object]:
    meta = read_header(path, full=TOKENIZER_ARRAYS).metadata
    return {k: v for k, v in meta.items() if k.startswith("tokenizer.ggml.")}


@pytest.mark.parametrize("name", [n for n, f in FAMILIES.items() if f.vocabulary])
def test_family_file_carries_the_real_vocabulary_and_template(name: str) -> None:
    """Every tokenizer.ggml.* key of llama.cpp's vocabulary GGUF, value for value, the real chat
    template, and the architecture the table names."""
    family = FAMILIES[name]
    path = family_model(name)
    meta = read_header(path).metadata
    assert meta["general.architecture"] == family.architecture
    assert meta["tokenizer.chat_template"] == template_source(family)
    assert tokenizer_keys(path) == tokenizer_keys(llama_sdist.vocab_path(family.vocabulary))


@pytest.mark.parametrize("name", [n for n, f in FAMILIES.items() if f.vocabulary])
def test_family_tokenizes_as_llama_cpp_test_vectors_say(name: str) -> None:
    """llama.cpp's own test-tokenizer-0 vectors of the family's vocabulary (add_special and
    parse_special off), and the corpus with special tokens as text in every mode, tokenize on
    the family's model file exactly as on llama.cpp's vocabulary GGUF."""
    family = FAMILIES[name]
    model, vocab = (
        Reference(family_model(name)),
        Reference(llama_sdist.vocab_path(family.vocabulary)),
    )
    try:
        vectors = llama_sdist.vectors(family.vocabulary)
        assert vectors is not None
        for text, ids in zip(vectors.texts, vectors.ids, strict=True):
            assert model.tokenize(text, add_special=False, parse_special=False) == ids, text
        texts = [*CORPUS, *family.end_of_turn, f"{family.end_of_turn[0]}\nHi"]
        for text, add, parse in itertools.product(texts, (False, True), (False, True)):
            got = model.tokenize(text, add_special=add, parse_special=parse)
            assert got == vocab.tokenize(text, add_special=add, parse_special=parse), text
    finally:
        model.close()
        vocab.close()


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_engine(request: pytest.FixtureRequest) -> Iterator[tuple[Family, EngineLoop]]:
    family = FAMILIES[request.param]
    settings = Settings(
        model=ModelSettings(
            model_path=str(family_model(family.name)),
            n_ctx=256,
            n_batch=128,
            n_threads=1,
            chat_template=family.server_template,
        ),
        scheduler=SchedulerSettings(n_parallel=1),
    )
    engine = build_engine(settings)
    yield family, engine
    engine.close()


async def test_family_loads_and_decodes(family_engine: tuple[Family, EngineLoop]) -> None:
    """llama.cpp loads the family's model and the engine decodes a token-id prompt: 4 tokens,
    each a token of the vocabulary."""
    family, engine = family_engine
    prompt = engine.tokenize("Hello world, how are you?", add_special=True, parse_special=False)
    request = GenerationRequest(
        f"family-{family.name}",
        tuple(prompt),
        SamplingParams(temperature=0.0),
        StoppingParams(max_tokens=4, ignore_eos=True),
    )
    out = await run(engine, request)
    assert isinstance(out.final, Finished)
    assert len(out.token_ids) == 4
    assert all(0 <= t < engine.model_info.n_vocab for t in out.token_ids)


def test_family_end_of_turn_tokens_end_generation(family_engine: tuple[Family, EngineLoop]) -> None:
    """Each end-of-turn text of the table is one special token, and llama.cpp counts it among
    the end-of-generation tokens (so the engine stops there)."""
    family, engine = family_engine
    eog = set(engine.model_info.eog_token_ids)
    for text in family.end_of_turn:
        (token,) = engine.tokenize(text, add_special=False, parse_special=True)
        assert token in eog, (text, token)
        assert engine.detokenize([token], render_special=True) == text


def test_family_messages_use_the_table_template(family_engine: tuple[Family, EngineLoop]) -> None:
    """The server renders `messages` with the template the table says: the one in the file
    (checked above), or for gemma3 (whose file has none) the built-in one it is started with."""
    family, engine = family_engine
    assert engine.model_info.has_chat_template == bool(family.template)
    assert engine.model_info.chat_template == (family.server_template or "gguf")
