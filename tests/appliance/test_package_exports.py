"""LMS exports: the .h5p is a Question Set an H5P site can read, the Moodle XML is a
question bank `question/format/xml` imports, the QTI package lists every item, and each
export gives the same bytes every time."""

from __future__ import annotations

import base64
import html
import io
import json
import re
import uuid
import zipfile
from typing import Any
from xml.etree import ElementTree as ET

import pytest

from appliance.packages.exports import (
    H5P_AUDIO,
    H5P_BLANKS,
    H5P_COLUMN,
    H5P_MULTI_CHOICE,
    H5P_QUESTION_SET,
    H5P_TRUE_FALSE,
    MOODLE_GRADES,
    ExportError,
    export_h5p,
    export_moodle_xml,
    export_qti3,
    h5p_libraries,
)
from appliance.packages.model import (
    INTRO_NARRATION,
    Choice,
    Item,
    ItemType,
    Manifest,
)
from tests.packages import (
    TRICKY,
    lesson_audio,
    lesson_items,
    lesson_manifest,
    tone_wav,
)

QTI = "{http://www.imsglobal.org/xsd/imsqtiasi_v3p0}"
CP = "{http://www.imsglobal.org/xsd/qti/qtiv3p0/imscp_v1p1}"


@pytest.fixture
def package() -> tuple[Manifest, dict[str, bytes]]:
    package_items = lesson_items()
    files = lesson_audio(package_items)
    return lesson_manifest(package_items, files), files


def read_h5p(data: bytes) -> tuple[zipfile.ZipFile, dict[str, Any], dict[str, Any]]:
    archive = zipfile.ZipFile(io.BytesIO(data))
    assert archive.testzip() is None
    return (
        archive,
        json.loads(archive.read("h5p.json")),
        json.loads(archive.read("content/content.json")),
    )


def text_of(fragment: str) -> str:
    """The plain text of an HTML fragment we wrote: tags dropped, entities decoded."""
    return html.unescape(re.sub(r"<[^>]+>", "", fragment))


# H5P


def test_h5p_json_has_every_mandatory_field(package: tuple[Manifest, dict[str, bytes]]) -> None:
    package_manifest, files = package

    _, h5p, _ = read_h5p(export_h5p(package_manifest, files))

    assert h5p["title"] == package_manifest.title
    assert h5p["language"] == "en"
    assert h5p["mainLibrary"] == "H5P.QuestionSet"
    assert h5p["embedTypes"] == ["iframe"]
    assert H5P_QUESTION_SET.dependency() in h5p["preloadedDependencies"]
    assert {"machineName": "H5P.QuestionSet", "majorVersion": 1, "minorVersion": 20} in h5p[
        "preloadedDependencies"
    ]
    used = {H5P_MULTI_CHOICE, H5P_TRUE_FALSE, H5P_BLANKS, H5P_AUDIO}
    assert all(lib.dependency() in h5p["preloadedDependencies"] for lib in used)


def test_h5p_holds_every_item_with_the_right_library_and_answers(
    package: tuple[Manifest, dict[str, bytes]],
) -> None:
    package_manifest, files = package

    _, _, content = read_h5p(export_h5p(package_manifest, files))

    assert content["progressType"] == "dots"
    assert content["passPercentage"] == 60
    assert content["introPage"]["title"] == package_manifest.title
    questions = content["questions"]
    assert len(questions) == len(package_manifest.items)
    expected_library = {
        ItemType.single_choice: "H5P.MultiChoice 1.16",
        ItemType.multiple_choice: "H5P.MultiChoice 1.16",
        ItemType.true_false: "H5P.TrueFalse 1.8",
        ItemType.short_answer: "H5P.Blanks 1.14",
    }
    for item, question in zip(package_manifest.items, questions, strict=True):
        assert question["library"] == expected_library[item.type]
        params = question["params"]
        if item.type is ItemType.true_false:
            assert text_of(params["question"]) == item.prompt
            assert params["correct"] == item.correct[0]
        elif item.type is ItemType.short_answer:
            assert text_of(params["text"]) == item.prompt
            assert params["questions"] == ["<p>*chlorophyll/chlorophyl*</p>"]
        else:
            assert text_of(params["question"]) == item.prompt
            expected_type = "single" if item.type is ItemType.single_choice else "multi"
            assert params["behaviour"]["type"] == expected_type
            assert [text_of(a["text"]) for a in params["answers"]] == [c.text for c in item.choices]
            assert [a["correct"] for a in params["answers"]] == [
                c.id in item.correct for c in item.choices
            ]


def test_h5p_feedback_goes_to_the_chosen_answer(
    package: tuple[Manifest, dict[str, bytes]],
) -> None:
    package_manifest, files = package

    _, _, content = read_h5p(export_h5p(package_manifest, files))

    answers = content["questions"][0]["params"]["answers"]
    assert answers[0]["tipsAndFeedback"]["chosenFeedback"] == "Yes: oxygen."
    assert answers[1]["tipsAndFeedback"]["chosenFeedback"] == "No: plants give off oxygen."
    true_false = content["questions"][3]["params"]["behaviour"]
    assert (true_false["feedbackOnCorrect"], true_false["feedbackOnWrong"]) == (
        "Right.",
        "They do need light.",
    )
    blanks = content["questions"][4]["params"]["overallFeedback"]
    assert blanks == [
        {"from": 0, "to": 99, "feedback": "It is chlorophyll."},
        {"from": 100, "to": 100, "feedback": "Well done."},
    ]


def test_h5p_subcontent_ids_are_stable_uuids(package: tuple[Manifest, dict[str, bytes]]) -> None:
    package_manifest, files = package
    other = package_manifest.model_copy(update={"id": "pkg_ffffffffffffffffffffffff"})

    ids = [q["subContentId"] for q in read_h5p(export_h5p(package_manifest, files))[2]["questions"]]
    other_ids = [q["subContentId"] for q in read_h5p(export_h5p(other, files))[2]["questions"]]

    assert all(uuid.UUID(i).version == 5 for i in ids)
    assert len(set(ids)) == len(ids)
    assert set(ids).isdisjoint(other_ids)


def test_h5p_carries_every_narration_byte_identical_and_referenced(
    package: tuple[Manifest, dict[str, bytes]],
) -> None:
    package_manifest, files = package

    archive, _, content = read_h5p(export_h5p(package_manifest, files))

    narrated = 0
    for item, question in zip(package_manifest.items, content["questions"], strict=True):
        if item.narration is None:
            assert "media" not in question["params"]
            continue
        narrated += 1
        name = item.narration.rsplit("/", 1)[-1]
        assert archive.read(f"content/audios/{name}") == files[item.narration]
        audio = question["params"]["media"]["type"]
        assert audio["library"] == "H5P.Audio 1.5"
        assert audio["params"]["files"] == [
            {"path": f"audios/{name}", "mime": "audio/wav", "copyright": {"license": "U"}}
        ]
    assert narrated == len(files) == 5
    assert sorted(n for n in archive.namelist() if n.startswith("content/audios/")) == [
        f"content/audios/q{i}.wav" for i in range(1, 6)
    ]


def test_h5p_without_narration_needs_no_audio_library() -> None:
    _, h5p, content = read_h5p(export_h5p(lesson_manifest(lesson_items(narration=False)), {}))

    assert H5P_AUDIO.dependency() not in h5p["preloadedDependencies"]
    assert all("media" not in q["params"] for q in content["questions"])


def test_h5p_lists_only_the_libraries_it_uses() -> None:
    only_true_false = [i for i in lesson_items(narration=False) if i.type is ItemType.true_false]

    _, h5p, _ = read_h5p(export_h5p(lesson_manifest(only_true_false), {}))

    assert h5p["preloadedDependencies"] == [
        H5P_QUESTION_SET.dependency(),
        H5P_TRUE_FALSE.dependency(),
    ]


def test_h5p_text_survives_escaping(package: tuple[Manifest, dict[str, bytes]]) -> None:
    package_manifest, files = package

    _, _, content = read_h5p(export_h5p(package_manifest, files))

    params = content["questions"][5]["params"]
    assert "<b>" not in params["answers"][0]["text"]
    assert text_of(params["question"]) == TRICKY
    assert [text_of(a["text"]) for a in params["answers"]] == [
        "Yes <b>",
        "No & never",
        'Only "sometimes"',
        "Don't know",
    ]


def test_h5p_refuses_a_missing_narration_file(package: tuple[Manifest, dict[str, bytes]]) -> None:
    package_manifest, files = package
    del files["audio/q2.wav"]

    with pytest.raises(ExportError, match=r"'audio/q2.wav' of item 'q2' is not among"):
        export_h5p(package_manifest, files)


def test_h5p_blanks_drop_answers_it_cannot_hold() -> None:
    item = Item(
        id="q1",
        type=ItemType.short_answer,
        prompt="What is half of one, written as a fraction?",
        correct=["1/2", "one half"],
    )
    _, _, content = read_h5p(export_h5p(lesson_manifest([item]), {}))
    assert content["questions"][0]["params"]["questions"] == ["<p>*one half*</p>"]

    only_reserved = item.model_copy(update={"correct": ["1/2"]})
    with pytest.raises(ExportError, match="H5P blanks cannot hold"):
        export_h5p(lesson_manifest([only_reserved]), {})


def test_h5p_zip_is_deterministic(package: tuple[Manifest, dict[str, bytes]]) -> None:
    package_manifest, files = package

    first = export_h5p(package_manifest, files)

    assert export_h5p(package_manifest, dict(reversed(files.items()))) == first
    archive = zipfile.ZipFile(io.BytesIO(first))
    assert archive.namelist() == sorted(archive.namelist())
    assert {info.date_time for info in archive.infolist()} == {(1980, 1, 1, 0, 0, 0)}


# Moodle XML


def parse_moodle(data: bytes) -> list[ET.Element]:
    quiz = ET.fromstring(data)  # noqa: S314 -- our own output, not untrusted input
    assert quiz.tag == "quiz"
    return quiz.findall("question")


def fractions(question: ET.Element) -> list[float]:
    return [float(a.attrib["fraction"]) for a in question.findall("answer")]


def test_moodle_xml_has_a_category_then_one_question_per_item(
    package: tuple[Manifest, dict[str, bytes]],
) -> None:
    package_manifest, _ = package

    category, *questions = parse_moodle(export_moodle_xml(package_manifest, package[1]))

    assert category.attrib["type"] == "category"
    assert category.findtext("category/text") == "$course$/top/Photosynthesis // plants & light"
    assert [q.attrib["type"] for q in questions] == [
        "multichoice",
        "multichoice",
        "multichoice",
        "truefalse",
        "shortanswer",
        "multichoice",
    ]
    for item, question in zip(package_manifest.items, questions, strict=True):
        [questiontext] = question.findall("questiontext")
        assert questiontext.attrib["format"] == "html"
        assert text_of(question.findtext("questiontext/text") or "") == item.prompt
        assert question.find("generalfeedback") is not None
        assert (question.findtext("name/text") or "").startswith(f"{item.id}: ")
    for question in questions:
        if question.attrib["type"] == "multichoice":
            assert question.findtext("answernumbering") == "abc"


def _shown_orders(package_items: list[Item]) -> dict[str, list[bool]]:
    """Whether each export lets the LMS shuffle each choice item's choices, per export."""
    manifest_ = lesson_manifest(package_items, lesson_audio(package_items))
    files = lesson_audio(package_items) if any(i.narration for i in package_items) else {}
    _, _, content = read_h5p(export_h5p(manifest_, files))
    h5p = [q["params"]["behaviour"]["randomAnswers"] for q in content["questions"]
           if "randomAnswers" in q["params"].get("behaviour", {})]  # fmt: skip
    moodle = [q.findtext("shuffleanswers") == "1"
              for q in parse_moodle(export_moodle_xml(manifest_, files))
              if q.attrib["type"] == "multichoice"]  # fmt: skip
    with zipfile.ZipFile(io.BytesIO(export_qti3(manifest_, files))) as qti:
        qti_shuffles = [
            ET.fromstring(qti.read(name)).find(f".//{QTI}qti-choice-interaction")  # noqa: S314
            for name in sorted(qti.namelist()) if name.startswith("items/")
        ]  # fmt: skip
    qti_orders = [i.attrib["shuffle"] == "true" for i in qti_shuffles if i is not None]
    return {"h5p": h5p, "moodle": moodle, "qti": qti_orders}


def test_narrated_choices_are_shown_in_the_order_they_are_read() -> None:
    """The narration reads an item's choices in the package's order: every export keeps that
    order for a narrated item (an LMS shuffling them would show one order and read another),
    and lets the LMS shuffle the choices of an item without narration."""
    # q1-q3 narrated, q6 not; QTI lists q4 (true/false) as well, never shuffled
    assert [i.id for i in lesson_items() if i.narration] == ["q1", "q2", "q3", "q4", "q5"]
    narrated = _shown_orders(lesson_items())
    assert narrated == {
        "h5p": [False, False, False, True],
        "moodle": [False, False, False, True],
        "qti": [False, False, False, False, True],
    }, narrated
    silent = _shown_orders(lesson_items(narration=False))
    # true/false (q4) keeps True before False
    assert silent == {"h5p": [True] * 4, "moodle": [True] * 4, "qti": [True] * 3 + [False, True]}


def test_moodle_single_choice_has_one_full_grade(
    package: tuple[Manifest, dict[str, bytes]],
) -> None:
    package_manifest, _ = package

    single = parse_moodle(export_moodle_xml(package_manifest, package[1]))[1]

    assert single.findtext("single") == "true"
    assert fractions(single) == [100, 0, 0, 0]
    answers = single.findall("answer")
    assert [a.findtext("text") for a in answers] == [
        "Oxygen",
        "Nitrogen",
        "Carbon dioxide",
        "Helium",
    ]
    assert answers[0].findtext("feedback/text") == "Yes: oxygen."


@pytest.mark.parametrize(("index", "n_correct"), [(2, 2), (3, 3)])
def test_moodle_multiple_choice_grades_sum_to_plus_and_minus_100(
    package: tuple[Manifest, dict[str, bytes]], index: int, n_correct: int
) -> None:
    package_manifest, _ = package

    question = parse_moodle(export_moodle_xml(package_manifest, package[1]))[index]

    assert question.findtext("single") == "false"
    grades = fractions(question)
    right = [g for g in grades if g > 0]
    wrong = [g for g in grades if g <= 0]
    assert len(right) == n_correct
    assert sum(right) == pytest.approx(100, abs=1e-3)
    assert sum(wrong) == pytest.approx(-100, abs=1e-3)
    assert all(abs(g) in MOODLE_GRADES for g in grades)


def test_moodle_true_false_and_short_answers(package: tuple[Manifest, dict[str, bytes]]) -> None:
    package_manifest, _ = package

    questions = parse_moodle(export_moodle_xml(package_manifest, package[1]))
    true_false, short = questions[4], questions[5]

    assert [(a.findtext("text"), a.attrib["fraction"]) for a in true_false.findall("answer")] == [
        ("true", "0"),
        ("false", "100"),
    ]
    answers = [(a.findtext("text"), a.attrib["fraction"]) for a in short.findall("answer")]
    assert answers == [("chlorophyll", "100"), ("chlorophyl", "100"), ("*", "0")]
    assert short.findall("answer")[-1].findtext("feedback/text") == "It is chlorophyll."


def test_moodle_short_answer_asterisks_are_literal() -> None:
    item = Item(
        id="q1",
        type=ItemType.short_answer,
        prompt="Which symbol multiplies in most programming languages?",
        correct=["*", "a*b"],
    )

    [_, question] = parse_moodle(export_moodle_xml(lesson_manifest([item]), {}))

    assert [a.findtext("text") for a in question.findall("answer")] == ["\\*", "a\\*b"]


def test_moodle_text_survives_escaping(package: tuple[Manifest, dict[str, bytes]]) -> None:
    package_manifest, _ = package

    question = parse_moodle(export_moodle_xml(package_manifest, package[1]))[6]

    assert text_of(question.findtext("questiontext/text") or "") == TRICKY
    assert [text_of(a.findtext("text") or "") for a in question.findall("answer")] == [
        "Yes <b>",
        "No & never",
        'Only "sometimes"',
        "Don't know",
    ]
    assert text_of(question.findtext("correctfeedback/text") or "") == "3 < 4 & so on."
    # As Moodle's editor writes them: quotes as they are (a `&#x27;` reference showed
    # literally in its right-answer summary), only &, < and > as entities.
    texts = [a.findtext("text") or "" for a in question.findall("answer")]
    assert texts[2:] == ['Only "sometimes"', "Don't know"]
    assert texts[0] == "Yes &lt;b&gt;"


def test_moodle_refuses_a_grade_it_does_not_offer() -> None:
    item = Item(
        id="q1",
        type=ItemType.multiple_choice,
        prompt="Which of these numbers are smaller than 2?",
        choices=[Choice(id=f"c{n}", text=str(n)) for n in range(1, 13)],
        correct=["c1"],
    )

    with pytest.raises(ExportError, match=r"grade of 9\.09091 %"):
        export_moodle_xml(lesson_manifest([item]), {})


def test_moodle_xml_is_deterministic(package: tuple[Manifest, dict[str, bytes]]) -> None:
    package_manifest, _ = package

    assert export_moodle_xml(package_manifest, package[1]) == export_moodle_xml(
        package_manifest, package[1]
    )


# QTI 3.0


def test_qti3_package_lists_every_item_and_its_narration(
    package: tuple[Manifest, dict[str, bytes]],
) -> None:
    package_manifest, files = package

    data = export_qti3(package_manifest, files)

    archive = zipfile.ZipFile(io.BytesIO(data))
    root = ET.fromstring(archive.read("imsmanifest.xml"))  # noqa: S314 -- our own output
    assert root.findtext(f"{CP}metadata/{CP}schema") == "QTI Package"
    resources = {r.attrib["identifier"]: r for r in root.iter(f"{CP}resource")}
    for item in package_manifest.items:
        resource = resources[f"item-{item.id}"]
        assert resource.attrib["type"] == "imsqti_item_xmlv3p0"
        qti = ET.fromstring(archive.read(resource.attrib["href"]))  # noqa: S314 -- our own output
        assert qti.tag == f"{QTI}qti-assessment-item"
        assert qti.attrib["identifier"] == item.id
        values = [v.text or "" for v in qti.iter(f"{QTI}qti-value")]
        if item.type is ItemType.short_answer:
            keys = [e.attrib["map-key"] for e in qti.iter(f"{QTI}qti-map-entry")]
            assert keys == item.correct
        else:
            assert sorted(values[:-1]) == sorted(item.correct)  # the last is SCORE's default
            choices = [c.attrib["identifier"] for c in qti.iter(f"{QTI}qti-simple-choice")]
            assert choices == [c.id for c in item.choices]
        if item.narration is not None:
            [dependency] = resource.findall(f"{CP}dependency")
            media = resources[dependency.attrib["identifierref"]]
            assert archive.read(media.attrib["href"]) == files[item.narration]
    assert export_qti3(package_manifest, files) == data


def test_moodle_carries_the_narration_of_the_introduction_and_of_each_item() -> None:
    """A narrated package in Moodle: a description question first, reading its introduction,
    then each narrated question with its WAV embedded in its text (`<file>`, base64, as
    Moodle's own export writes a file) and a player for it; the bytes are the package's."""
    package_items = lesson_items()
    files = lesson_audio(package_items) | {INTRO_NARRATION: tone_wav(2.0, tone=9)}
    category, intro, *questions = parse_moodle(
        export_moodle_xml(lesson_manifest(package_items, files), files)
    )
    assert category.attrib["type"] == "category"
    assert intro.attrib["type"] == "description"
    assert intro.findtext("defaultgrade") == "0"

    def embedded(question: ET.Element) -> tuple[str, bytes]:
        [file] = question.findall("questiontext/file")
        assert (file.attrib["path"], file.attrib["encoding"]) == ("/", "base64")
        name = file.attrib["name"]
        player = f'<audio controls="controls" src="@@PLUGINFILE@@/{name}"></audio>'
        assert (question.findtext("questiontext/text") or "").endswith(player)
        return name, base64.b64decode(file.text or "")

    assert embedded(intro) == ("intro.wav", files[INTRO_NARRATION])
    for item, question in zip(package_items, questions, strict=True):
        if item.narration is None:
            assert question.findall("questiontext/file") == []
        else:
            assert embedded(question) == (f"{item.id}.wav", files[item.narration])
    with pytest.raises(ExportError, match="not among the package files"):
        export_moodle_xml(lesson_manifest(package_items, files), {})


def test_h5p_reads_the_introduction_in_an_audio_above_the_set() -> None:
    """A narrated package in H5P: QuestionSet's introduction page holds text only, so the
    introduction's narration is an H5P.Audio, then the set, in an H5P.Column."""
    package_items = lesson_items()
    files = lesson_audio(package_items) | {INTRO_NARRATION: tone_wav(2.0, tone=9)}
    data = export_h5p(lesson_manifest(package_items, files), files)
    archive = zipfile.ZipFile(io.BytesIO(data))
    h5p = json.loads(archive.read("h5p.json"))
    column = json.loads(archive.read("content/content.json"))

    assert h5p["mainLibrary"] == "H5P.Column"
    assert H5P_COLUMN.dependency() in h5p["preloadedDependencies"]
    audio, question_set = (part["content"] for part in column["content"])
    assert audio["library"] == "H5P.Audio 1.5"
    assert audio["params"]["files"][0]["path"] == "audios/intro.wav"
    assert archive.read("content/audios/intro.wav") == files[INTRO_NARRATION]
    assert question_set["library"] == "H5P.QuestionSet 1.20"
    assert len(question_set["params"]["questions"]) == len(package_items)
    assert export_h5p(lesson_manifest(package_items, files), files) == data  # deterministic


def test_h5p_declares_the_newer_minor_versions_a_site_has() -> None:
    """A site with only QuestionSet 1.21 refuses content declaring 1.20 (H5P checks an
    upload's versions exactly): the export names the versions asked for, in h5p.json and in
    every `library` of the content alike; the oldest stay where none is asked."""
    package_items = lesson_items()
    files = lesson_audio(package_items) | {INTRO_NARRATION: tone_wav(2.0, tone=9)}
    asked = h5p_libraries("H5P.QuestionSet-1.21, H5P.Column 1.18")
    archive = zipfile.ZipFile(
        io.BytesIO(export_h5p(lesson_manifest(package_items, files), files, asked))
    )
    h5p = json.loads(archive.read("h5p.json"))
    content = archive.read("content/content.json").decode()

    declared = {d["machineName"]: (d["majorVersion"], d["minorVersion"])
                for d in h5p["preloadedDependencies"]}  # fmt: skip
    assert declared["H5P.QuestionSet"] == (1, 21)
    assert declared["H5P.Column"] == (1, 18)
    assert declared["H5P.MultiChoice"] == (1, 16)
    assert '"H5P.QuestionSet 1.21"' in content
    assert "H5P.QuestionSet 1.20" not in content


@pytest.mark.parametrize(
    ("asked", "says"),
    [
        ("H5P.QuestionSet-1.19", "needs H5P.QuestionSet 1.20 or a newer 1.x"),
        ("H5P.QuestionSet-2.0", "needs H5P.QuestionSet 1.20 or a newer 1.x"),
        ("H5P.CoursePresentation-1.25", "is not one of the libraries"),
        ("H5P.QuestionSet-one", "is not one of the libraries"),
        ("H5P.QuestionSet", "is not one of the libraries"),
    ],
)
def test_h5p_versions_it_cannot_play_are_refused(asked: str, says: str) -> None:
    with pytest.raises(ExportError, match=re.escape(says)):
        h5p_libraries(asked)


def test_qti3_wraps_the_items_in_an_assessment_test_that_reads_the_introduction() -> None:
    """The QTI package's assessment test: listed first in the manifest, depending on every
    item (and on the introduction's narration), one part, one section referencing each item
    in the package's order, the introduction read in the section's rubric block."""
    package_items = lesson_items()
    files = lesson_audio(package_items) | {INTRO_NARRATION: tone_wav(2.0, tone=9)}
    data = export_qti3(lesson_manifest(package_items, files), files)
    archive = zipfile.ZipFile(io.BytesIO(data))
    root = ET.fromstring(archive.read("imsmanifest.xml"))  # noqa: S314 -- our own output
    first = root.find(f"{CP}resources/{CP}resource")
    assert first is not None
    assert (first.attrib["type"], first.attrib["href"]) == ("imsqti_test_xmlv3p0", "assessment.xml")
    depends = [d.attrib["identifierref"] for d in first.findall(f"{CP}dependency")]
    assert depends == [f"item-{i.id}" for i in package_items] + ["media-intro"]
    test = ET.fromstring(archive.read("assessment.xml"))  # noqa: S314 -- our own output
    assert test.tag == f"{QTI}qti-assessment-test"
    [part] = test.findall(f"{QTI}qti-test-part")
    [section] = part.findall(f"{QTI}qti-assessment-section")
    refs = [(r.attrib["identifier"], r.attrib["href"])
            for r in section.findall(f"{QTI}qti-assessment-item-ref")]  # fmt: skip
    assert refs == [(i.id, f"items/{i.id}.xml") for i in package_items]
    assert all(href in archive.namelist() for _, href in refs)
    [audio] = section.iter(f"{QTI}audio")
    assert archive.read(audio.attrib["src"]) == files[INTRO_NARRATION]
    # Without narration: the test still wraps the items, and reads nothing.
    silent = lesson_items(narration=False)
    archive = zipfile.ZipFile(io.BytesIO(export_qti3(lesson_manifest(silent), {})))
    test = ET.fromstring(archive.read("assessment.xml"))  # noqa: S314 -- our own output
    assert len(list(test.iter(f"{QTI}qti-assessment-item-ref"))) == len(silent)
    assert list(test.iter(f"{QTI}audio")) == []
