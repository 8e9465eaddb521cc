"""What the learner trains on: prompts released under the staleness bound (the dispatcher), scored groups admitted
from the replay stream (the batch source), eval rounds, the record of which step trained each group, and preference
pairs for DPO."""
