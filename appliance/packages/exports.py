"""LMS exports of a finished package: pure functions from a manifest (and the package's
files) to the bytes of one export file.

- `export_h5p`: an H5P Question Set (`.h5p`), content only: the target site must already
  have the libraries named in `H5P_LIBRARIES`, or the newer minor versions the export is
  asked for (`h5p_libraries`). A narrated package's introduction is read by an H5P.Audio
  before the set, the two in an H5P.Column.
- `export_moodle_xml`: a Moodle XML question bank, one category holding every item.
- `export_qti3`: a QTI 3.0 content package (`imsmanifest.xml` and one item per question).

Every export is deterministic: the same manifest and files give the same bytes (zip
entries sorted, every timestamp 1980-01-01, fixed permissions; JSON and XML written in a
fixed order).
"""

from __future__ import annotations

import base64
import html
import io
import json
import uuid
import zipfile
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import TYPE_CHECKING, Any
from xml.etree import ElementTree as ET

from appliance.packages.model import INTRO_NARRATION, Item, ItemType

if TYPE_CHECKING:
    from collections.abc import Mapping

    from appliance.packages.model import Manifest


class ExportError(ValueError):
    """The package cannot be expressed in the export format: a narration file is missing
    or of a type the format does not take, or an item has nothing the format can mark
    correct."""


@dataclass(frozen=True, slots=True)
class Library:
    """An H5P library version as the content refers to it."""

    machine_name: str
    major: int
    minor: int

    @property
    def ref(self) -> str:
        """The `library` string of sub-content: "H5P.MultiChoice 1.16"."""
        return f"{self.machine_name} {self.major}.{self.minor}"

    def dependency(self) -> dict[str, Any]:
        return {
            "machineName": self.machine_name,
            "majorVersion": self.major,
            "minorVersion": self.minor,
        }


# The oldest H5P library versions the content is written for: every field it uses is in
# them. A site checks an upload's versions exactly (H5P's core and h5p-server alike), so
# one that has only newer minor versions (QuestionSet 1.21) is given those by name
# (`h5p_libraries`): a minor version of an H5P library reads its older minors' content.
H5P_QUESTION_SET = Library("H5P.QuestionSet", 1, 20)
H5P_MULTI_CHOICE = Library("H5P.MultiChoice", 1, 16)
H5P_TRUE_FALSE = Library("H5P.TrueFalse", 1, 8)
H5P_BLANKS = Library("H5P.Blanks", 1, 14)
H5P_AUDIO = Library("H5P.Audio", 1, 5)
H5P_COLUMN = Library("H5P.Column", 1, 16)
H5P_LIBRARIES = (
    H5P_COLUMN, H5P_QUESTION_SET, H5P_MULTI_CHOICE, H5P_TRUE_FALSE, H5P_BLANKS, H5P_AUDIO
)  # fmt: skip


def h5p_libraries(asked: str) -> dict[Library, Library]:
    """The library versions an export is asked for ("H5P.QuestionSet-1.21,H5P.Audio-1.5",
    H5P's own notation; a space for the dash too), each ours replaced by it. ExportError
    for a library the export does not use, another major version, or an older minor."""
    ours = {lib.machine_name: lib for lib in H5P_LIBRARIES}
    known = ", ".join(f"{n}-{v.major}.{v.minor}" for n, v in ours.items())
    chosen: dict[Library, Library] = {}
    for part in filter(None, (p.strip() for p in asked.split(","))):
        name, _, version = part.replace(" ", "-").rpartition("-")
        major, _, minor = version.partition(".")
        if name not in ours or not (major.isdigit() and minor.isdigit()) or len(version) > 9:
            raise ExportError(
                f"{part!r} is not one of the libraries an export uses at a version "
                f"(NAME-MAJOR.MINOR: {known})."
            )
        base = ours[name]
        if int(major) != base.major or int(minor) < base.minor:
            raise ExportError(
                f"{part!r}: the export needs {name} {base.major}.{base.minor} or a newer "
                f"{base.major}.x; a site with only another major version cannot play it."
            )
        chosen[base] = Library(name, int(major), int(minor))
    return chosen


H5P_PASS_PERCENTAGE = 60

# sub-content ids are uuid5 of "<package id>/<item id>[/audio]" in this namespace, so an
# export of the same package keeps them and an LMS keeps learners' results.
SUBCONTENT_NAMESPACE = uuid.uuid5(uuid.NAMESPACE_URL, "urn:kovenlab-edge:h5p-subcontent")

# Audio types H5P's default content whitelist takes, by file extension.
AUDIO_MIME = {".wav": "audio/wav", ".ogg": "audio/ogg", ".mp3": "audio/mpeg", ".m4a": "audio/mp4"}

# H5P.Blanks reads "*a/b:tip*" as a blank accepting "a" or "b" with a tip, so an accepted
# answer holding one of these characters cannot be written as a blank.
BLANKS_RESERVED = frozenset("*/:")

# The grades Moodle accepts for an answer, in percent (question_bank::fraction_options_full,
# positive half); an import with any other fraction is refused.
MOODLE_GRADES = (
    100.0, 90.0, 83.33333, 80.0, 75.0, 70.0, 66.66667, 60.0, 50.0, 40.0,
    33.33333, 30.0, 25.0, 20.0, 16.66667, 14.28571, 12.5, 11.11111, 10.0, 5.0,
)  # fmt: skip

QTI_NS = "http://www.imsglobal.org/xsd/imsqtiasi_v3p0"
QTI_CP_NS = "http://www.imsglobal.org/xsd/qti/qtiv3p0/imscp_v1p1"
QTI_TEST = "assessment.xml"
XSI_NS = "http://www.w3.org/2001/XMLSchema-instance"
QTI_MATCH_CORRECT = "https://purl.imsglobal.org/spec/qti/v3p0/rptemplates/match_correct"
QTI_MAP_RESPONSE = "https://purl.imsglobal.org/spec/qti/v3p0/rptemplates/map_response"

_ZIP_EPOCH = (1980, 1, 1, 0, 0, 0)


# H5P


def export_h5p(
    manifest: Manifest,
    files: Mapping[str, bytes],
    libraries: Mapping[Library, Library] | None = None,
) -> bytes:
    """The package as an H5P Question Set: `h5p.json`, `content/content.json` and each
    item's narration under `content/audios/`, referenced from the question's media; with
    the introduction's narration, an H5P.Column of an H5P.Audio reading it, then the set.

    single and multiple choice become H5P.MultiChoice, true/false H5P.TrueFalse and short
    answers H5P.Blanks (the prompt as the task, one blank accepting every answer; answers
    holding "*", "/" or ":", which are Blanks markup, are left out). `libraries` names
    newer minor versions to declare (`h5p_libraries`). Raises `ExportError` when a
    narration file is missing or an item cannot be expressed.
    `files` maps package paths ("audio/item-1.wav") to their bytes.
    """
    chosen = dict(libraries or {})

    def ref(library: Library) -> str:
        used.add(library)
        return chosen.get(library, library).ref

    used = {H5P_QUESTION_SET}
    entries: dict[str, bytes] = {}
    questions = []
    for item in manifest.items:
        library, params = _h5p_question(item)
        if item.narration is not None:
            name = _h5p_audio_file(item.id, item.narration, files, entries)
            audio = _h5p_audio(name, _subcontent_id(manifest.id, item.id, "audio"), item.id)
            params["media"] = {
                "type": {"library": ref(H5P_AUDIO), **audio},
                "disableImageZooming": False,
            }
        questions.append(
            {
                "library": ref(library),
                "subContentId": _subcontent_id(manifest.id, item.id),
                "params": params,
                "metadata": {"license": "U", "title": item.id},
            }
        )
    content: dict[str, Any] = {
        "introPage": {
            "showIntroPage": True,
            "title": manifest.title,
            "introduction": _para(manifest.topic),
        },
        "progressType": "dots",
        "passPercentage": H5P_PASS_PERCENTAGE,
        "disableBackwardsNavigation": False,
        "randomQuestions": False,
        "questions": questions,
    }
    main = H5P_QUESTION_SET
    if INTRO_NARRATION in {f.path for f in manifest.files}:
        # QuestionSet's introduction page holds text only: the narrated introduction is an
        # Audio above the set, both in a Column (what H5P's authors build by hand).
        name = _h5p_audio_file("intro", INTRO_NARRATION, files, entries)
        audio = _h5p_audio(name, _subcontent_id(manifest.id, "intro", "audio"), "intro")
        set_ref = ref(H5P_QUESTION_SET)
        content = {
            "content": [
                {"content": {"library": ref(H5P_AUDIO), **audio}, "useSeparator": "disabled"},
                {
                    "content": {
                        "library": set_ref,
                        "params": content,
                        "subContentId": _subcontent_id(manifest.id, "set"),
                        "metadata": {"contentType": "Question Set", "license": "U",
                                     "title": manifest.title},
                    },
                    "useSeparator": "auto",
                },
            ]
        }  # fmt: skip
        main = H5P_COLUMN
        used.add(main)
    h5p = {
        "title": manifest.title,
        "language": manifest.spec.language.split("-", 1)[0].lower(),
        "mainLibrary": main.machine_name,
        "embedTypes": ["iframe"],
        "license": "U",
        "preloadedDependencies": [
            chosen.get(lib, lib).dependency() for lib in H5P_LIBRARIES if lib in used
        ],
    }
    entries["h5p.json"] = _json(h5p)
    entries["content/content.json"] = _json(content)
    return _zip(entries)


def _h5p_audio_file(
    item_id: str, narration: str, files: Mapping[str, bytes], entries: dict[str, bytes]
) -> str:
    """A narration file put under content/audios/ (ExportError: missing, of a type H5P
    does not take, or a second file of the same name)."""
    path, data = _narration(item_id, narration, files)
    previous = entries.setdefault(f"content/audios/{path.name}", data)
    if previous != data:
        raise ExportError(f"Two narration files are named {path.name!r}; give each item its own.")
    return path.name


def _h5p_audio(name: str, subcontent: str, title: str) -> dict[str, Any]:
    """An H5P.Audio's params, id and metadata for content/audios/NAME (its `library` is
    the caller's)."""
    return {
        "params": {
            "files": [
                {
                    "path": f"audios/{name}",
                    "mime": AUDIO_MIME[PurePosixPath(name).suffix],
                    "copyright": {"license": "U"},
                }
            ],
            "playerMode": "minimalistic",
            "fitToWrapper": False,
            "controls": True,
            "autoplay": False,
        },
        "subContentId": subcontent,
        "metadata": {"contentType": "Audio", "license": "U", "title": title},
    }


def _h5p_question(item: Item) -> tuple[Library, dict[str, Any]]:
    correct = set(item.correct)
    if item.type is ItemType.true_false:
        answer = _one_of(item, correct & {"true", "false"})
        return H5P_TRUE_FALSE, {
            "question": _para(item.prompt),
            "correct": answer,
            "behaviour": {
                "enableRetry": True,
                "enableSolutionsButton": True,
                "enableCheckButton": True,
                "confirmCheckDialog": False,
                "confirmRetryDialog": False,
                "autoCheck": False,
                "feedbackOnCorrect": _html(item.feedback.correct),
                "feedbackOnWrong": _html(item.feedback.incorrect),
            },
        }
    if item.type is ItemType.short_answer:
        spaced = dict.fromkeys(" ".join(a.split()) for a in item.correct if a.strip())
        answers = [a for a in spaced if not BLANKS_RESERVED & set(a)]
        if not answers:
            raise ExportError(
                f"Item {item.id!r} has no accepted answer without '*', '/' or ':', "
                "which H5P blanks cannot hold; reword its answers."
            )
        return H5P_BLANKS, {
            "text": _para(item.prompt),
            "questions": [f"<p>*{'/'.join(html.escape(a) for a in answers)}*</p>"],
            "behaviour": {
                "enableRetry": True,
                "enableSolutionsButton": True,
                "enableCheckButton": True,
                "caseSensitive": False,
                "showSolutionsRequiresInput": True,
                "autoCheck": False,
                "confirmCheckDialog": False,
                "confirmRetryDialog": False,
            },
            # One blank scores 0 % or 100 %.
            "overallFeedback": [
                {"from": 0, "to": 99, "feedback": _html(item.feedback.incorrect)},
                {"from": 100, "to": 100, "feedback": _html(item.feedback.correct)},
            ],
        }
    _require_correct(item)
    return H5P_MULTI_CHOICE, {
        "question": _para(item.prompt),
        "answers": [
            {
                "text": f"<div>{_html(choice.text)}</div>",
                "correct": choice.id in correct,
                "tipsAndFeedback": {
                    "tip": "",
                    "chosenFeedback": _html(
                        item.feedback.correct if choice.id in correct else item.feedback.incorrect
                    ),
                    "notChosenFeedback": "",
                },
            }
            for choice in item.choices
        ],
        "behaviour": {
            "type": "single" if item.type is ItemType.single_choice else "multi",
            "singlePoint": False,
            "randomAnswers": _shuffled(item),
            "enableRetry": True,
            "enableSolutionsButton": True,
            "enableCheckButton": True,
            "showSolutionsRequiresInput": True,
            "confirmCheckDialog": False,
            "confirmRetryDialog": False,
            "autoCheck": False,
            "passPercentage": 100,
            "showScorePoints": True,
        },
        "overallFeedback": [{"from": 0, "to": 100, "feedback": ""}],
    }


def _subcontent_id(package_id: str, item_id: str, part: str = "") -> str:
    name = f"{package_id}/{item_id}" + (f"/{part}" if part else "")
    return str(uuid.uuid5(SUBCONTENT_NAMESPACE, name))


def _narration(
    item_id: str, narration: str, files: Mapping[str, bytes]
) -> tuple[PurePosixPath, bytes]:
    path = PurePosixPath(narration)
    if path.suffix.lower() not in AUDIO_MIME:
        raise ExportError(
            f"Narration {narration!r} of item {item_id!r} is not one of "
            f"{', '.join(sorted(AUDIO_MIME))}; store it as WAV."
        )
    data = files.get(narration)
    if data is None:
        raise ExportError(
            f"Narration {narration!r} of item {item_id!r} is not among the package files."
        )
    return path.with_suffix(path.suffix.lower()), data


# Moodle XML


def export_moodle_xml(manifest: Manifest, files: Mapping[str, bytes]) -> bytes:
    """The package as a Moodle XML question bank: a category question (the package
    title under the course's top category) followed by one question per item, in the
    elements `question/format/xml/format.php` imports: multichoice (single or multiple
    answers), truefalse and shortanswer. A narrated package starts with a description
    question (no grade) holding its introduction's narration; each narrated question holds
    its own, an `<audio>` player in its text and the WAV as the text's embedded file
    (`@@PLUGINFILE@@`, base64), as Moodle's own export writes files. `files` maps package
    paths to their bytes.

    Text is HTML (prompt, choices and feedback are escaped into it) except answers of
    true/false and short answer questions, which Moodle reads as plain text. Multiple
    choice grades split 100 % among the correct choices and -100 % among the wrong ones;
    a short answer's incorrect feedback sits on a "*" (anything else) answer worth 0, and
    an asterisk in an accepted answer is escaped as "\\*".
    """
    quiz = ET.Element("quiz")
    category = ET.SubElement(quiz, "question", type="category")
    # Moodle reads "/" as a category separator and "//" as a literal slash.
    _text(ET.SubElement(category, "category"), f"$course$/top/{manifest.title.replace('/', '//')}")
    _text(ET.SubElement(category, "info", format="html"), _para(manifest.topic))
    if any(entry.path == INTRO_NARRATION for entry in manifest.files):
        quiz.append(_moodle_intro(manifest, files))
    for item in manifest.items:
        question = _moodle_question(manifest.id, item)
        if item.narration is not None:
            _moodle_audio(question.find("questiontext"), item.id, item.narration, files)
        quiz.append(question)
    # Empty elements as <text></text>, the way Moodle's own export writes them.
    return _xml(quiz, short_empty_elements=False)


def _moodle_question(package_id: str, item: Item) -> ET.Element:
    qtype = {
        ItemType.single_choice: "multichoice",
        ItemType.multiple_choice: "multichoice",
        ItemType.true_false: "truefalse",
        ItemType.short_answer: "shortanswer",
    }[item.type]
    question = ET.Element("question", type=qtype)
    _text(ET.SubElement(question, "name"), _question_name(item))
    _text(ET.SubElement(question, "questiontext", format="html"), _para(item.prompt))
    _text(ET.SubElement(question, "generalfeedback", format="html"), "")
    ET.SubElement(question, "defaultgrade").text = "1.0000000"
    ET.SubElement(question, "penalty").text = "0.3333333"
    ET.SubElement(question, "hidden").text = "0"
    ET.SubElement(question, "idnumber").text = f"{package_id}-{item.id}"
    right, wrong = _html(item.feedback.correct), _html(item.feedback.incorrect)
    if item.type is ItemType.true_false:
        answer = _one_of(item, set(item.correct) & {"true", "false"})
        for value in ("true", "false"):
            hit = value == answer
            _moodle_answer(question, "100" if hit else "0", value, right if hit else wrong, "")
        return question
    if item.type is ItemType.short_answer:
        ET.SubElement(question, "usecase").text = "0"
        answers = dict.fromkeys(a.strip() for a in item.correct if a.strip())
        for text in answers:
            # "*" is Moodle's wildcard; a backslash before it makes it a literal asterisk.
            _moodle_answer(question, "100", text.replace("*", "\\*"), right, "")
        if wrong:
            _moodle_answer(question, "0", "*", wrong, "")
        return question
    correct = _require_correct(item)
    single = item.type is ItemType.single_choice
    ET.SubElement(question, "single").text = "true" if single else "false"
    ET.SubElement(question, "shuffleanswers").text = "1" if _shuffled(item) else "0"
    ET.SubElement(question, "answernumbering").text = "abc"
    _text(ET.SubElement(question, "correctfeedback", format="html"), right)
    _text(ET.SubElement(question, "partiallycorrectfeedback", format="html"), "")
    _text(ET.SubElement(question, "incorrectfeedback", format="html"), wrong)
    ET.SubElement(question, "shownumcorrect")
    n_wrong = len(item.choices) - len(correct)
    for choice in item.choices:
        hit = choice.id in correct
        if single:
            fraction = "100" if hit else "0"
        elif hit:
            fraction = _moodle_grade(item, len(correct))
        else:
            fraction = "-" + _moodle_grade(item, n_wrong)
        _moodle_answer(question, fraction, _html(choice.text), right if hit else wrong, "html")
    return question


def _moodle_intro(manifest: Manifest, files: Mapping[str, bytes]) -> ET.Element:
    """A description question (Moodle's text without an answer) reading the package's
    introduction: shown before the questions, graded nothing."""
    question = ET.Element("question", type="description")
    _text(ET.SubElement(question, "name"), f"intro: {' '.join(manifest.title.split())[:80]}")
    text = ET.SubElement(question, "questiontext", format="html")
    _text(text, _para(manifest.title))
    _moodle_audio(text, "intro", INTRO_NARRATION, files)
    _text(ET.SubElement(question, "generalfeedback", format="html"), "")
    ET.SubElement(question, "defaultgrade").text = "0"
    ET.SubElement(question, "penalty").text = "0"
    ET.SubElement(question, "hidden").text = "0"
    ET.SubElement(question, "idnumber").text = f"{manifest.id}-intro"
    return question


def _moodle_audio(
    text: ET.Element | None, item_id: str, narration: str, files: Mapping[str, bytes]
) -> None:
    """The narration as a file embedded in a question's text, and a player for it there."""
    if text is None:
        raise ExportError(f"Item {item_id!r} has no question text to hold its narration.")
    path, data = _narration(item_id, narration, files)
    shown = text.find("text")
    if shown is None:
        raise ExportError(f"Item {item_id!r} has no question text to hold its narration.")
    player = f'<audio controls="controls" src="@@PLUGINFILE@@/{path.name}"></audio>'
    shown.text = (shown.text or "") + player
    embedded = ET.SubElement(text, "file", name=path.name, path="/", encoding="base64")
    embedded.text = base64.b64encode(data).decode("ascii")


def _moodle_answer(
    question: ET.Element, fraction: str, text: str, feedback: str, text_format: str
) -> None:
    answer = ET.SubElement(question, "answer", fraction=fraction)
    if text_format:
        answer.set("format", text_format)
    ET.SubElement(answer, "text").text = text
    _text(ET.SubElement(answer, "feedback", format="html"), feedback)


def _moodle_grade(item: Item, parts: int) -> str:
    """100 % split into `parts` equal grades, as Moodle writes it ("33.33333")."""
    share = round(100 / parts, 5)
    if not any(abs(share - grade) < 1e-4 for grade in MOODLE_GRADES):
        raise ExportError(
            f"Item {item.id!r} would need a grade of {share} %, which Moodle does not offer; "
            "use fewer choices."
        )
    return f"{share:.5f}".rstrip("0").rstrip(".")


def _question_name(item: Item) -> str:
    prompt = " ".join(item.prompt.split())
    return f"{item.id}: {prompt[:80]}" if prompt else item.id


def _text(parent: ET.Element, text: str) -> None:
    ET.SubElement(parent, "text").text = text


# QTI 3.0


def export_qti3(manifest: Manifest, files: Mapping[str, bytes]) -> bytes:
    """The package as a QTI 3.0 content package: `imsmanifest.xml`, an assessment test
    (`assessment.xml`: one part, one section holding the items in the package's order, which
    some delivery platforms require to take items at all), one `items/<item id>.xml` per item
    and each narration under `media/`; a narrated package's introduction is read in the
    section's rubric block, shown before its items.

    Choice items are `qti-choice-interaction`s scored by match_correct (all or nothing);
    short answers are `qti-text-entry-interaction`s scored by map_response, each accepted
    answer mapped to 1 case-insensitively.
    """
    entries: dict[str, bytes] = {}
    resources = ET.Element("resources")
    media_resources = []
    for item in manifest.items:
        href = f"items/{item.id}.xml"
        resource = ET.SubElement(
            resources,
            "resource",
            identifier=f"item-{item.id}",
            type="imsqti_item_xmlv3p0",
            href=href,
        )
        ET.SubElement(resource, "file", href=href)
        media = None
        if item.narration is not None:
            media, media_resource = _qti_media(item.id, item.narration, files, entries)
            ET.SubElement(resource, "dependency", identifierref=f"media-{item.id}")
            media_resources.append(media_resource)
        entries[href] = _xml(_qti_item(item, manifest.spec.language, media))
    resources.extend(media_resources)
    intro = None
    if any(entry.path == INTRO_NARRATION for entry in manifest.files):
        intro, intro_resource = _qti_media("intro", INTRO_NARRATION, files, entries)
        resources.append(intro_resource)
    test = ET.Element(
        "resource",
        identifier=f"test-{manifest.id}",
        type="imsqti_test_xmlv3p0",
        href=QTI_TEST,
    )
    ET.SubElement(test, "file", href=QTI_TEST)
    for item in manifest.items:
        ET.SubElement(test, "dependency", identifierref=f"item-{item.id}")
    if intro is not None:
        ET.SubElement(test, "dependency", identifierref="media-intro")
    resources.insert(0, test)
    entries[QTI_TEST] = _xml(_qti_test(manifest, intro))
    root = ET.Element(
        "manifest",
        {
            "identifier": f"manifest-{manifest.id}",
            "xmlns": QTI_CP_NS,
            "xmlns:xsi": XSI_NS,
            "xsi:schemaLocation": (
                f"{QTI_CP_NS} https://purl.imsglobal.org/spec/qti/v3p0/schema/xsd/"
                "imsqtiv3p0_imscpv1p2_v1p0.xsd"
            ),
        },
    )
    metadata = ET.SubElement(root, "metadata")
    ET.SubElement(metadata, "schema").text = "QTI Package"
    ET.SubElement(metadata, "schemaversion").text = "3.0.0"
    ET.SubElement(root, "organizations")
    root.append(resources)
    entries["imsmanifest.xml"] = _xml(root)
    return _zip(entries)


def _qti_media(
    owner: str, narration: str, files: Mapping[str, bytes], entries: dict[str, bytes]
) -> tuple[str, ET.Element]:
    """A narration put under `media/`, and its manifest resource (`media-OWNER`)."""
    path, data = _narration(owner, narration, files)
    href = f"media/{owner}{path.suffix}"
    entries[href] = data
    resource = ET.Element("resource", identifier=f"media-{owner}", type="webcontent", href=href)
    ET.SubElement(resource, "file", href=href)
    return href, resource


def _qti_test(manifest: Manifest, intro: str | None) -> ET.Element:
    root = ET.Element(
        "qti-assessment-test",
        {
            "xmlns": QTI_NS,
            "xmlns:xsi": XSI_NS,
            "xsi:schemaLocation": (
                f"{QTI_NS} https://purl.imsglobal.org/spec/qti/v3p0/schema/xsd/"
                "imsqti_asiv3p0_v1p0.xsd"
            ),
            "identifier": f"test-{manifest.id}",
            "title": " ".join(manifest.title.split()),
            "xml:lang": manifest.spec.language,
        },
    )
    part = ET.SubElement(
        root,
        "qti-test-part",
        {"identifier": "part-1", "navigation-mode": "nonlinear", "submission-mode": "individual"},
    )
    section = ET.SubElement(
        part,
        "qti-assessment-section",
        {"identifier": "section-1", "title": " ".join(manifest.title.split()), "visible": "true"},
    )
    rubric = ET.SubElement(
        section, "qti-rubric-block", {"use": "instructions", "view": "candidate"}
    )
    body = ET.SubElement(rubric, "qti-content-body")
    ET.SubElement(body, "p").text = manifest.topic.strip()
    if intro is not None:
        ET.SubElement(body, "audio", {"controls": "controls", "src": intro})
    for item in manifest.items:
        ET.SubElement(
            section,
            "qti-assessment-item-ref",
            {"identifier": item.id, "href": f"items/{item.id}.xml"},
        )
    return root


def _qti_item(item: Item, language: str, media: str | None) -> ET.Element:
    # Elements are unqualified under the root's literal `xmlns`: ElementTree would otherwise
    # spell the namespace with generated prefixes (ns0:).
    root = ET.Element(
        "qti-assessment-item",
        {
            "xmlns": QTI_NS,
            "xmlns:xsi": XSI_NS,
            "xsi:schemaLocation": (
                f"{QTI_NS} https://purl.imsglobal.org/spec/qti/v3p0/schema/xsd/"
                "imsqti_asiv3p0_v1p0.xsd"
            ),
            "identifier": item.id,
            "title": _question_name(item),
            "adaptive": "false",
            "time-dependent": "false",
            "xml:lang": language,
        },
    )
    short = item.type is ItemType.short_answer
    declaration = ET.SubElement(
        root,
        "qti-response-declaration",
        {
            "identifier": "RESPONSE",
            "cardinality": "multiple" if item.type is ItemType.multiple_choice else "single",
            "base-type": "string" if short else "identifier",
        },
    )
    answers = (
        list(dict.fromkeys(a.strip() for a in item.correct if a.strip()))
        if short
        else sorted(_require_correct(item), key=[c.id for c in item.choices].index)
    )
    if not answers:
        raise ExportError(f"Item {item.id!r} has no accepted answer; add one.")
    correct = ET.SubElement(declaration, "qti-correct-response")
    for answer in answers[:1] if short else answers:
        ET.SubElement(correct, "qti-value").text = answer
    if short:
        mapping = ET.SubElement(declaration, "qti-mapping", {"default-value": "0"})
        for answer in answers:
            ET.SubElement(
                mapping,
                "qti-map-entry",
                {"map-key": answer, "mapped-value": "1", "case-sensitive": "false"},
            )
    outcome = ET.SubElement(
        root,
        "qti-outcome-declaration",
        {"identifier": "SCORE", "cardinality": "single", "base-type": "float"},
    )
    default = ET.SubElement(outcome, "qti-default-value")
    ET.SubElement(default, "qti-value").text = "0"
    body = ET.SubElement(root, "qti-item-body")
    if media is not None:
        ET.SubElement(body, "audio", {"controls": "controls", "src": f"../{media}"})
    if short:
        ET.SubElement(body, "p").text = item.prompt.strip()
        ET.SubElement(
            ET.SubElement(body, "p"),
            "qti-text-entry-interaction",
            {"response-identifier": "RESPONSE"},
        )
    else:
        interaction = ET.SubElement(
            body,
            "qti-choice-interaction",
            {
                "response-identifier": "RESPONSE",
                "max-choices": "0" if item.type is ItemType.multiple_choice else "1",
                "shuffle": "true"
                if _shuffled(item) and item.type is not ItemType.true_false
                else "false",
            },
        )
        ET.SubElement(interaction, "qti-prompt").text = item.prompt.strip()
        for choice in item.choices:
            ET.SubElement(
                interaction, "qti-simple-choice", {"identifier": choice.id}
            ).text = choice.text.strip()
    ET.SubElement(
        root,
        "qti-response-processing",
        {"template": QTI_MAP_RESPONSE if short else QTI_MATCH_CORRECT},
    )
    return root


# Shared


def _shuffled(item: Item) -> bool:
    """Whether an LMS may show the item's choices in an order of its own: not when its
    narration reads them, in the package's order (the student would hear one order and see
    another)."""
    return item.narration is None


def _require_correct(item: Item) -> set[str]:
    """The item's correct choice ids; a choice item without any cannot be scored."""
    ids = {c.id for c in item.choices}
    correct = set(item.correct) & ids
    if not correct:
        raise ExportError(f"Item {item.id!r} marks no choice correct; validate it first.")
    return correct


def _one_of(item: Item, candidates: set[str]) -> str:
    if len(candidates) != 1:
        raise ExportError(f"Item {item.id!r} needs exactly one of 'true' and 'false' correct.")
    return next(iter(candidates))


def _html(text: str) -> str:
    # Text content, never an attribute: only &, < and > need escaping. Quotes escaped as
    # well (`&#x27;`) showed literally in Moodle's right-answer summary, which turns the
    # answer's HTML into plain text without decoding numeric references.
    return html.escape(text.strip(), quote=False)


def _para(text: str) -> str:
    return f"<p>{_html(text)}</p>" if text.strip() else ""


def _json(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False, indent=2).encode()


def _xml(root: ET.Element, *, short_empty_elements: bool = True) -> bytes:
    ET.indent(root)
    document: bytes = ET.tostring(
        root, encoding="UTF-8", xml_declaration=True, short_empty_elements=short_empty_elements
    )
    return document + b"\n"


def _zip(entries: Mapping[str, bytes]) -> bytes:
    """A zip of `entries` in name order with fixed timestamps and permissions, so that the
    same entries always give the same bytes."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for name in sorted(entries):
            info = zipfile.ZipInfo(name, date_time=_ZIP_EPOCH)
            info.compress_type = zipfile.ZIP_DEFLATED
            info.create_system = 3  # unix, so that the permissions below are read
            info.external_attr = 0o644 << 16
            archive.writestr(info, entries[name])
    return buffer.getvalue()
