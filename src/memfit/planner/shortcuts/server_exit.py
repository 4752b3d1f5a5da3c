"""Imported by the search's worker server alone, first (:func:`memfit.planner.shortcuts.workers.start_worker_server`
preloads it): the server, which only forks workers, ends without tearing its modules down
(:mod:`memfit.exits`). It shares the command's output streams, so a command whose output is piped
is done only when the server has ended too; and what it imports for the workers (bitsandbytes, for
``memfit ui``) says nothing there."""

from memfit.exits import skip_teardown_at_exit
from memfit.planner.shortcuts.workers import quiet_bitsandbytes_import

skip_teardown_at_exit()
quiet_bitsandbytes_import()
