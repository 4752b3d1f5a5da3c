"""Imported by the search's worker server alone (:func:`memfit.planner.workers.start_worker_server`
preloads it): the server, which only forks workers, ends without tearing its modules down
(:mod:`memfit.exits`). It shares the command's output streams, so a command whose output is piped
is done only when the server has ended too."""

from memfit.exits import skip_teardown_at_exit

skip_teardown_at_exit()
