"""bench/c_survey.py: the C survey of seeded fused specs (its draws, its check of one spec, its table)."""
from __future__ import annotations

import tensorstep as ts
from tensorstep.bench import c_survey, launch_bounds


def test_the_draws_add_dofs_goal_indices_and_accuracies_to_the_ptxas_surveys():
    drawn = c_survey.specs(60, 39)
    assert {s.dof for s in drawn} == set(c_survey.DOFS)
    assert any(s.goal_index for s in drawn) and any(s.end == "goal" and not s.goal_index for s in drawn)
    defaults = {(4, 4, 2), (4, 4, 2, 2), (1, 1, 1), (1, 1, 1, 1)}  # spec.py DEFAULT_ACCURACY, orders 3 and 4
    assert {s.accuracy for s in drawn if s.control == "position"} - defaults
    assert max(s.horizon for s in drawn) >= 200 and max(s.knots or 0 for s in drawn) == 64
    # the ptxas surveys' draws as they were (bench/launch_bounds.py ``draw``, the default)
    assert launch_bounds.specs(5, 3) == launch_bounds.specs(5, 3, drawing=launch_bounds.draw)
    assert not any(s.goal_index for s in launch_bounds.specs(60, 3))


def test_one_spec_passes_and_a_wrong_cost_is_found(monkeypatch):
    """A short spec's C step, each form, against the plain step plus the terms: within the tolerance;
    with the terms' reference off by a part in 1e9, the spec fails on its values."""
    from tensorstep.runtime import costs

    spec = ts.KernelSpec(horizon=12, dof=3, dtype="float64", end="goal", goal_index=True, start_index=True,
                         costs=(("bound", "velocity"), ("squared", "position")), outputs=("P",))
    row = c_survey.check(spec)
    assert row.failure == "" and {f"{call} {name}" for call, _, _ in c_survey.CALLS
                                  for name in ("P", "cost", "du", "dp0", "dgoal0", "dtarget")} <= set(row.errors)
    assert max(row.errors.values()) <= c_survey.TOLERANCE["float64"]
    term_values = costs.term_values
    monkeypatch.setattr(costs, "term_values", lambda *a, **k: term_values(*a, **k) * (1 + 1e-9))
    wrong = c_survey.check(spec)
    assert wrong.failure == "values" and wrong.errors["general cost"] > 0.9e-9


def test_the_table_counts_each_failure():
    fields = ts.KernelSpec(horizon=12, dof=3, dtype="float64", costs=(("squared", "position"),)).to_dict()
    rows = [c_survey.Row("a", fields, 2.0, errors={"general P": 1e-16}),
            c_survey.Row("b", fields, 3.0, "load", "NameError: TS_REREAD", {}),
            c_survey.Row("c", fields, 4.0, "values", "general du: 1.0e-08", {"general du": 1e-8})]
    lines = c_survey.table(rows)
    assert lines[2:4] == ["| b | load | NameError: TS_REREAD |", "| c | values | general du: 1.0e-08 |"]
    assert lines[4] == "\n3 specs: 1 pass, 1 load, 1 values"
    assert lines[5].startswith("float64: 2 specs run, largest difference 1.0e-08")
