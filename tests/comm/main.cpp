#include "ranks.h"

int main(int argc, char** argv) { return strata::test::test_main(argc, argv); }
