"""Operations tests: the launcher, weights tools and deployment artefacts as operators use them."""
