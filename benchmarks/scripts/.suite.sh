export PYTHONPATH=src EMBER_GIT_COMMIT=$(cat .commit)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
JOBS=${1:-resnet50_train,bert_train,vgg16_train,mobilenet_v3_train,densenet121_train,resnet50v2_train,cyclegan_train,style_transfer_train,bert_infer_bs1,resnet50_infer_bs1,vit_b16_train,vit_b16_infer,swin_t_train,swin_t_infer,convnext_t_train,convnext_t_infer,efficientnet_b0_train,efficientnet_b0_infer,gpt2_train,gpt2_infer,llama_train,llama_infer,t5_train,t5_infer,bart_train,bart_infer,lstm_lm_train,lstm_lm_infer}
python benchmarks/scripts/gpu_suite.py --plan main --gpus 4 --jobs $JOBS --budget ${2:-555} --min-left 60 --out $OUT/suite 2>&1 | grep -v Warn | tail -60
${3:-true}
cd $OUT && tar czf suite.tgz suite && rm -rf suite
