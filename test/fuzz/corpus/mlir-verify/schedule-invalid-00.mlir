msched.resource @r device size(-1) category("device arena")
