"""test/Docs/Inputs/check_doc.py's comparison of shown and printed output:
exact, or with numbers within a relative tolerance where a page says so."""
import importlib.util
import pathlib

REPO = pathlib.Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location(
    "check_doc", REPO / "test" / "Docs" / "Inputs" / "check_doc.py")
check_doc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check_doc)

SHOWN = "loss: first 1.12883, last 0.71880 (64% of the first)"


def test_exact_without_a_tolerance():
    assert check_doc.same_output(SHOWN, SHOWN, None)
    assert not check_doc.same_output(SHOWN, SHOWN.replace("0.71880", "0.71877"),
                                     None)


def test_numbers_within_the_tolerance():
    near = SHOWN.replace("0.71880", "0.71877")
    assert check_doc.same_output(SHOWN, near, 1e-4)
    assert not check_doc.same_output(SHOWN, near, 1e-5)
    assert not check_doc.same_output(SHOWN, SHOWN.replace("64%", "65%"), 1e-3)


def test_the_words_must_still_match():
    assert not check_doc.same_output(SHOWN, SHOWN.replace("last", "final"), 1)
    assert not check_doc.same_output(SHOWN, SHOWN + " 3", 1)


def test_the_marker_takes_a_tolerance(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("<!-- doc-check: run -->\n```sh\necho 1.0001\n```\n\n"
                    "<!-- doc-check: output, numbers within 1e-3 -->\n"
                    "```\n1.0\n```\n")
    kinds = [(kind, argument) for kind, argument, _, _ in
             check_doc.blocks(str(page))]
    assert kinds == [("run", None), ("output", 1e-3)]
