"""StepGuess: whether a streamed decode step runs as one whole graph on the guess that every
expert it routes to is resident already.

Through a cache smaller than the pool the decode runner goes layer by layer: the host reads each
layer's routes and makes its experts resident before the segment that uses them (a graph per
layer, a host round trip between). When the cache holds every expert a step routes to (a warm
cache on a conversation's working set), those round trips only confirm it, and cost the step
~67 µs a layer over the one-graph step (H200, 8 layers of 256 experts through a 36 % cache
that held every routed expert). So the runner may instead replay the one-graph step, whose kernels
read experts through the slot table (an expert that is not resident reads a resident one's
slot, a wrong but harmless value), check the step's routes against the cache once the graph has
run, and redo the step layer by layer when an expert was missing (engine/decode_graph.py). A
wrong guess costs a whole step's device time; this policy decides when to guess, from what
recent steps saw:

- a guess is made once `needed` consecutive steps had every routed expert resident at its layer
  (a layered step's `resident` checks all true; a right guess; a step of the whole pool);
- a wrong guess doubles the streak the next guess needs (from `least`, at most `most`): a
  conversation moving to experts the cache lacks does not pay a wasted step each time;
- a right guess halves it again (not below `least`).

A graphed prefill chunk step (`DecodeRunner.chunk`) is guessed by the same policy: its tokens'
experts are the conversation's, like the decode steps' around it. Its outcome moves the policy as
a decode step's does and is also counted on its own (`chunks`, `chunks_wrong`).

`least=0, most=0` guesses every step (tests, comparisons). Engine-thread bookkeeping only.
"""

from __future__ import annotations


class StepGuess:
    """When to run a streamed step whole (module docstring); counts guesses and wrong ones."""

    def __init__(self, least: int = 1, most: int = 64):
        if not 0 <= least <= most:
            raise ValueError(f"a step guess needs 0 <= least <= most, got least={least}, most={most}")
        self.least, self.most = least, most
        self.reset()

    def reset(self) -> None:
        """The policy and its counts as they started (after the warm-up, whose repeated token is
        not a conversation's)."""
        self.needed = self.least  # consecutive all-resident steps the next guess needs
        self.streak = 0  # consecutive steps whose routed experts were all resident
        self.guesses = 0  # steps run whole on the guess (chunk steps included)
        self.wrong = 0  # of those, redone layer by layer
        self.chunks = 0  # of the guesses, prefill chunk steps
        self.chunks_wrong = 0  # of those, redone

    def ready(self) -> bool:
        """Whether the next streamed step should be guessed whole."""
        return self.streak >= self.needed

    def observed(self, all_resident: bool) -> None:
        """A step not guessed: whether every expert it routed to was resident at its layer."""
        self.streak = self.streak + 1 if all_resident else 0

    def right(self, chunk: bool = False) -> None:
        """A guessed step's experts were all resident: its result stands (`chunk`: a prefill
        chunk step's)."""
        self.guesses += 1
        self.chunks += chunk
        self.streak += 1
        self.needed = max(self.least, self.needed // 2)

    def missed(self, chunk: bool = False) -> None:
        """A guessed step routed to an expert that was not resident: it is redone layer by layer
        (`chunk`: a prefill chunk step's, its tokens redone as decode steps)."""
        self.guesses += 1
        self.wrong += 1
        self.chunks += chunk
        self.chunks_wrong += chunk
        self.streak = 0
        self.needed = min(self.most, max(1, 2 * self.needed))
