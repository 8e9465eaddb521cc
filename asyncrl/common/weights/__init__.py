"""The weight group: flat dtype buckets broadcast from the learner to every actor's workers over one
``torch.distributed`` group (:mod:`.group`), formed through a store in the run's Redis (:mod:`.rendezvous`).
"""
