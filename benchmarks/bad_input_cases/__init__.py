"""The cases of benchmarks/bad_inputs.py, a module a topic. Each module holds ``CASES`` (a list of
``bad_inputs.Case``) and ``make_inputs(root)``, which writes the files its cases name into the
case's inputs folder (``{d}`` in a case's line). Names must not collide across modules."""
