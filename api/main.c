/* main.c - the sluice command: dispatches to a subcommand. */
#include <stdio.h>
#include <unistd.h>
#include <string.h>

#include "api.h"


static void usage(void)
{
    fprintf(stderr,
            "sluice %s - an LLM serving runtime\n\n"
            "usage: sluice COMMAND [flags]   (sluice COMMAND --help for its flags)\n\n"
            "commands:\n"
            "  serve      OpenAI-compatible HTTP server (chat, completions, models, metrics)\n"
            "  generate   generate text from a prompt, or chat interactively (--chat)\n"
            "  tokenize   text to token ids (--text) or ids to text (--ids)\n"
            "  template   the prompt a chat renders to with the model's chat template\n"
            "  info       build capabilities and a model's configuration\n"
            "  quantize   write a W4A16/W8A16 compressed-tensors copy of a model (round-to-nearest)\n"
            "  run-batch  run an OpenAI batch file (JSONL) through the continuous-batching engine\n"
            "  batch      submit, watch, cancel and fetch batch jobs on a running server\n"
            "  bench      cache-bust / cache-hit benchmark of any OpenAI-compatible server\n",
            SLUICE_VERSION);
}

int main(int argc, char **argv)
{
    if (argc < 2 || !strcmp(argv[1], "--help") || !strcmp(argv[1], "-h") || !strcmp(argv[1], "help")) {
        usage();
        return argc < 2 ? 2 : 0;
    }
    if (!strcmp(argv[1], "--version")) {
        printf("sluice %s\n", SLUICE_VERSION);
        return 0;
    }
    if (!strcmp(argv[1], "serve")) {
        int rc = api_cmd_serve(argc, argv);
        if (rc == API_EXIT_NOW) { /* a GPU failed: its driver state may hang an orderly exit */
            fflush(NULL);
            _exit(1);
        }
        return rc;
    }
    if (!strcmp(argv[1], "generate")) return api_cmd_generate(argc, argv);
    if (!strcmp(argv[1], "tokenize")) return api_cmd_tokenize(argc, argv);
    if (!strcmp(argv[1], "info")) return api_cmd_info(argc, argv);
    if (!strcmp(argv[1], "quantize")) return api_cmd_quantize(argc, argv);
    if (!strcmp(argv[1], "run-batch")) return api_cmd_run_batch(argc, argv);
    if (!strcmp(argv[1], "template")) return api_cmd_template(argc, argv);
    if (!strcmp(argv[1], "batch")) return api_cmd_batch(argc, argv);
    if (!strcmp(argv[1], "bench")) return api_cmd_bench(argc, argv);
    fprintf(stderr, "sluice: unknown command '%s'\n\n", argv[1]);
    usage();
    return 2;
}
