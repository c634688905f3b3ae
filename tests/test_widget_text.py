"""helpers.runner.widget_text (issue 30): an executed notebook keeps its tqdm bars at their final state, as text."""

from __future__ import annotations

import nbformat

from helpers.runner import widget_text


def _notebook_with_a_bar(value: float, other_widget: bool = False):
    state = {"box": {"model_name": "HBoxModel", "state": {"children": ["IPY_MODEL_l", "IPY_MODEL_p", "IPY_MODEL_r"]}},
             "l": {"model_name": "HTMLModel", "state": {"value": "training:\u2007100%"}},
             "p": {"model_name": "FloatProgressModel", "state": {"value": value, "max": 1000.0}},
             "r": {"model_name": "HTMLModel", "state": {"value": "\u20071000/1000\u2007[01:43&lt;00:00]"}},
             "slider": {"model_name": "IntSliderModel", "state": {"value": 3}}}
    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("train()")
    frozen = {"text/plain": "training:   0%|          | 0/1000 [00:00<?, ?it/s]", widget_text.VIEW: {"model_id": "box"}}
    cell.outputs = [nbformat.v4.new_output("display_data", data=frozen),
                    nbformat.v4.new_output("stream", name="stdout", text="done\n")]
    if other_widget:
        cell.outputs.append(nbformat.v4.new_output("display_data", data={"text/plain": "IntSlider(3)",
                                                                          widget_text.VIEW: {"model_id": "slider"}}))
    nb.cells = [cell]
    nb.metadata["widgets"] = {widget_text.STATE: {"state": state, "version_major": 2, "version_minor": 0}}
    return nb


def test_a_finished_bar_is_saved_as_its_final_text_and_the_widget_state_goes(tmp_path):
    nb = _notebook_with_a_bar(1000.0)
    path = tmp_path / "executed.ipynb"
    nbformat.write(nb, path)
    assert widget_text.rewrite(path) == 1
    saved = nbformat.read(path, as_version=4)
    assert saved.cells[0].outputs[0]["data"] == {"text/plain": "training: 100%|##########| 1000/1000 [01:43<00:00]"}
    assert saved.cells[0].outputs[1]["text"] == "done\n" and "widgets" not in saved.metadata
    assert widget_text.rewrite(path) == 0  # nothing left to replace: the file is not rewritten


def test_a_bar_stopped_midway_shows_where_and_other_widgets_keep_their_state():
    nb = _notebook_with_a_bar(350.0, other_widget=True)
    assert widget_text.progress_as_text(nb) == 1
    assert nb.cells[0].outputs[0]["data"]["text/plain"].split("|")[1] == "###       "
    assert widget_text.VIEW in nb.cells[0].outputs[2]["data"] and "widgets" in nb.metadata
